"""megatron-core ``TransformerConfig``s of vision towers and projector MLPs: what every tower's
``configs.py`` builds from, with its own choices (gated MLP, norm kind and epsilon) as arguments."""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.configs import activation, common
from loongforge.models.decoder.configs import recompute as recompute_settings


def _whole_on_a_stage(vision_tp: int) -> dict:
    # A tower lives whole on the first pipeline stage and is never sequence-parallel.
    return dict(tensor_model_parallel_size=vision_tp, pipeline_model_parallel_size=1, sequence_parallel=False)


def tower_config(vision: Any, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool, *, recompute: bool,
                 gated: bool, normalization: str, eps: float) -> TransformerConfig:
    """A ViT's blocks from ``vision`` (``depth``, ``hidden_size``, ``intermediate_size``, ``num_heads``,
    ``hidden_act``: ``model.vision`` or a tower's own facts): full multi-head attention, biased qkv,
    output projection and MLP (``gated``: SwiGLU-style), ``normalization`` pre-norms of ``eps``."""
    return TransformerConfig(
        num_layers=vision.depth,
        hidden_size=vision.hidden_size,
        ffn_hidden_size=vision.intermediate_size,
        num_attention_heads=vision.num_heads,
        num_query_groups=vision.num_heads,
        kv_channels=vision.hidden_size // vision.num_heads,
        layernorm_epsilon=eps,
        gated_linear_unit=gated,
        activation_func=activation(vision.hidden_act, "model.vision.hidden_act"),
        add_bias_linear=True,
        **_whole_on_a_stage(vision_tp),
        **recompute_settings(recompute),
        **{**common(params_dtype, on_cpu), "normalization": normalization},
    )


def projector_mlp_config(*, out_width: int, ffn_width: int, heads: int, hidden_act: str, vision_tp: int,
                         params_dtype: torch.dtype, on_cpu: bool, normalization: str = "RMSNorm",
                         eps: Optional[float] = None) -> TransformerConfig:
    """A projector's MLP as a megatron ``MLP``: input -> ``ffn_width`` -> ``out_width`` (``hidden_size``
    is the MLP's *output* width), biased linears; ``heads``: the tower's (unused by an MLP, but
    TransformerConfig checks it divides the TP size); ``normalization`` / ``eps``: of a norm fused into
    its first linear, if it has one."""
    norm = {"normalization": normalization, **({} if eps is None else {"layernorm_epsilon": eps})}
    return TransformerConfig(
        num_layers=1,
        hidden_size=out_width,
        ffn_hidden_size=ffn_width,
        num_attention_heads=heads,
        gated_linear_unit=False,
        activation_func=activation(hidden_act, "model.projector.hidden_act"),
        add_bias_linear=True,
        **_whole_on_a_stage(vision_tp),
        **{**common(params_dtype, on_cpu), **norm},
    )


def layer_norm_vit_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                          recompute: bool = False) -> TransformerConfig:
    """The blocks of a plain ViT from ``model.vision`` (InternViT, SigLIP): LayerNorm pre-norms of
    ``rms_norm_eps``, an ungated MLP."""
    vision = model_cfg.vision
    return tower_config(vision, vision_tp, params_dtype, on_cpu, recompute=recompute, gated=False,
                        normalization="LayerNorm", eps=vision.rms_norm_eps)


def to_language_width_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool, *,
                             norm_eps: Optional[float] = None) -> TransformerConfig:
    """A projector MLP whose hidden and output widths are the language model's (LLaVA's, InternVL's):
    input -> LM hidden -> LM hidden; ``norm_eps``: of a LayerNorm fused into its first linear."""
    out = model_cfg.projector.out_hidden_size
    norm = {} if norm_eps is None else {"normalization": "LayerNorm", "eps": norm_eps}
    return projector_mlp_config(out_width=out, ffn_width=out, heads=model_cfg.vision.num_heads,
                                hidden_act=model_cfg.projector.hidden_act, vision_tp=vision_tp,
                                params_dtype=params_dtype, on_cpu=on_cpu, **norm)
