"""megatron-core ``TransformerConfig``s of InternVL's vision part, from ``model.vision`` and
``model.projector``: InternViT's blocks and the pixel-shuffle projector's MLP."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.configs import activation, common
from loongforge.models.decoder.configs import recompute as recompute_settings

# The projector's LayerNorm: transformers' ``nn.LayerNorm`` default.
PROJECTOR_NORM_EPS = 1e-5
_NORMS = {"layer": "LayerNorm", "rms": "RMSNorm"}


def vision_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                  recompute: bool = False) -> TransformerConfig:
    """InternViT's blocks: pre-norms (LayerNorm or RMSNorm), biased qkv / proj / MLP, a plain GELU
    MLP, no rotary (absolute learned positions are added before the first block)."""
    vis = model_cfg.vision
    return TransformerConfig(
        num_layers=vis.depth,
        hidden_size=vis.hidden_size,
        ffn_hidden_size=vis.intermediate_size,
        num_attention_heads=vis.num_heads,
        num_query_groups=vis.num_heads,
        kv_channels=vis.hidden_size // vis.num_heads,
        layernorm_epsilon=vis.rms_norm_eps,
        gated_linear_unit=False,
        activation_func=activation(vis.hidden_act, "model.vision.hidden_act"),
        add_bias_linear=True,
        # The tower lives whole on the first pipeline stage and never sequence-parallel.
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **recompute_settings(recompute),
        **{**common(params_dtype, on_cpu), "normalization": _NORMS[vis.norm]},
    )


def projector_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype,
                     on_cpu: bool) -> TransformerConfig:
    """The projector as a megatron ``MLP`` with its LayerNorm fused into the first linear:
    m^2 x vision hidden -> LM hidden -> LM hidden (``hidden_size`` is the MLP's output width)."""
    out = model_cfg.projector.out_hidden_size
    return TransformerConfig(
        num_layers=1,
        hidden_size=out,
        ffn_hidden_size=out,
        # Unused by an MLP, but TransformerConfig checks it divides the TP size; the ViT's does.
        num_attention_heads=model_cfg.vision.num_heads,
        layernorm_epsilon=PROJECTOR_NORM_EPS,
        gated_linear_unit=False,
        activation_func=activation(model_cfg.projector.hidden_act, "model.projector.hidden_act"),
        add_bias_linear=True,
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **{**common(params_dtype, on_cpu), "normalization": "LayerNorm"},
    )
