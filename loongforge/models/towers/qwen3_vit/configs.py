"""megatron-core ``TransformerConfig``s of Qwen3-VL's vision part from its vision facts
(``vision_facts.Qwen3VisionConfig``): the ViT blocks (LayerNorm pre-norms, a plain MLP) and the
mergers' MLPs."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.towers.qwen3_vit.vision_facts import (
    VISION_LAYER_NORM_EPS,
    Qwen3VisionConfig,
)
from loongforge.models.vlm.vision_configs import projector_mlp_config, tower_config


def vision_config(vision: Qwen3VisionConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                  recompute: bool = False) -> TransformerConfig:
    return tower_config(vision, vision_tp, params_dtype, on_cpu, recompute=recompute, gated=False,
                        normalization="LayerNorm", eps=VISION_LAYER_NORM_EPS)


def merger_config(vision: Qwen3VisionConfig, vision_tp: int, params_dtype: torch.dtype,
                  on_cpu: bool) -> TransformerConfig:
    """A merger's MLP: merged width -> merged width -> out_hidden, exact GELU."""
    return projector_mlp_config(out_width=vision.out_hidden_size, ffn_width=vision.merged_width,
                                heads=vision.num_heads, hidden_act="gelu", vision_tp=vision_tp,
                                params_dtype=params_dtype, on_cpu=on_cpu)
