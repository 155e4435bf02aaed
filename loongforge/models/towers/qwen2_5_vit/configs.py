"""megatron-core ``TransformerConfig``s of Qwen2.5-VL's vision part, from ``model.vision`` and
``model.projector``: the ViT blocks (RMSNorm pre-norms, a SwiGLU MLP) and the patch merger's MLP."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.vlm.vision_configs import projector_mlp_config, tower_config


def vision_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
                  recompute: bool = False) -> TransformerConfig:
    vis = model_cfg.vision
    return tower_config(vis, vision_tp, params_dtype, on_cpu, recompute=recompute, gated=True,
                        normalization="RMSNorm", eps=vis.rms_norm_eps)


def projector_config(model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype,
                     on_cpu: bool) -> TransformerConfig:
    """The merger MLP: 4 x vision hidden -> 4 x vision hidden -> out_hidden."""
    merged_width = model_cfg.vision.hidden_size * model_cfg.projector.spatial_merge_size**2
    return projector_mlp_config(out_width=model_cfg.projector.out_hidden_size, ffn_width=merged_width,
                                heads=model_cfg.vision.num_heads, hidden_act=model_cfg.projector.hidden_act,
                                vision_tp=vision_tp, params_dtype=params_dtype, on_cpu=on_cpu)
