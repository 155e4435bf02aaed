"""megatron-core ``TransformerConfig``s of Qwen3-VL's vision tower and mergers, from its vision facts
(``vision_facts.Qwen3VisionConfig``). The language model is the shared decoder
(``models.decoder.configs``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.decoder.configs import activation, common
from loongforge.models.decoder.configs import recompute as recompute_settings
from loongforge.models.towers.qwen3_vit.vision_facts import VISION_LAYER_NORM_EPS, Qwen3VisionConfig


def vision_config(vision: Qwen3VisionConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                  recompute: bool = False) -> TransformerConfig:
    """The ViT blocks: LayerNorm (with bias) pre-norms, biased qkv/proj/MLP, a plain (ungated) MLP."""
    return TransformerConfig(
        num_layers=vision.depth,
        hidden_size=vision.hidden_size,
        ffn_hidden_size=vision.intermediate_size,
        num_attention_heads=vision.num_heads,
        num_query_groups=vision.num_heads,
        kv_channels=vision.head_dim,
        layernorm_epsilon=VISION_LAYER_NORM_EPS,
        gated_linear_unit=False,
        activation_func=activation(vision.hidden_act, "model.vision.hidden_act"),
        add_bias_linear=True,
        # The tower lives whole on the first pipeline stage and never sequence-parallel.
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **recompute_settings(recompute),
        **{**common(params_dtype, on_cpu), "normalization": "LayerNorm"},
    )


def merger_config(vision: Qwen3VisionConfig, vision_tp: int, params_dtype: torch.dtype,
                  on_cpu: bool) -> TransformerConfig:
    """A merger's MLP as a megatron ``MLP``: merged width -> merged width -> out_hidden, exact GELU.

    ``hidden_size`` is the MLP's *output* width (megatron's MLP maps input_size -> ffn -> hidden).
    """
    return TransformerConfig(
        num_layers=1,
        hidden_size=vision.out_hidden_size,
        ffn_hidden_size=vision.merged_width,
        # Unused by an MLP, but TransformerConfig checks it divides the TP size; the ViT's does.
        num_attention_heads=vision.num_heads,
        gated_linear_unit=False,
        activation_func=activation("gelu", "model.projector.hidden_act"),
        add_bias_linear=True,
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **common(params_dtype, on_cpu),
    )
