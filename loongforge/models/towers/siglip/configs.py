"""megatron-core ``TransformerConfig``s of LLaVA-OneVision's vision part: SigLIP's blocks and the
two-layer MLP projector."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.configs import activation, common
from loongforge.models.decoder.configs import recompute as recompute_settings


def vision_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                  recompute: bool = False) -> TransformerConfig:
    """SigLIP's blocks: LayerNorm pre-norms, biased qkv / out / MLP, a plain MLP (tanh GELU), no
    rotary (learned absolute positions are added to the patch embeddings)."""
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
        **{**common(params_dtype, on_cpu), "normalization": "LayerNorm"},
    )


def projector_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype,
                     on_cpu: bool) -> TransformerConfig:
    """The projector as a megatron ``MLP``: vision hidden -> LM hidden -> LM hidden."""
    out = model_cfg.projector.out_hidden_size
    return TransformerConfig(
        num_layers=1,
        hidden_size=out,
        ffn_hidden_size=out,
        # Unused by an MLP, but TransformerConfig checks it divides the TP size; the ViT's does.
        num_attention_heads=model_cfg.vision.num_heads,
        gated_linear_unit=False,
        activation_func=activation(model_cfg.projector.hidden_act, "model.projector.hidden_act"),
        add_bias_linear=True,
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **common(params_dtype, on_cpu),
    )
