"""Qwen3-VL's vision facts, and megatron-core ``TransformerConfig``s of its vision tower and mergers.

loongforge's ``ModelConfig.vision`` / ``.projector`` describe Qwen2.5-VL's tower (RMSNorm, windows,
a gated MLP); Qwen3-VL adds learned position embeddings and DeepStack. Until the schema carries
those fields, ``Qwen3VisionConfig`` holds every vision fact this family reads, built from
transformers' ``vision_config`` (``from_hf``) or from a ``ModelConfig`` that has the proposed fields
(``from_model_cfg``). The language model is the shared decoder (``models.decoder.configs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.configs import activation, common
from loongforge.models.decoder.configs import recompute as recompute_settings

# transformers builds every vision LayerNorm (blocks and mergers) with this epsilon, not from the config.
VISION_LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """The ViT, its merger and the DeepStack mergers (transformers' ``Qwen3VLVisionConfig``)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    # The mergers' output width; must equal the language model's hidden size.
    out_hidden_size: int = 3584
    # Learned position embeddings: a square grid of sqrt(n) x sqrt(n), resampled to each image.
    num_position_embeddings: int = 2304
    # Vision blocks whose outputs (through a merger each) are added after decoder layers 0..k-1.
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings={self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision deepstack_visual_indexes {bad} are not blocks of a depth-{self.depth} tower")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_width(self) -> int:
        """Width of one merge unit's concatenated patch features."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_deepstack_layers(self) -> int:
        return len(self.deepstack_visual_indexes)

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> "Qwen3VisionConfig":
        """From transformers' ``vision_config`` (a dict, or the config object's ``to_dict()``)."""
        names = [f for f in cls.__dataclass_fields__ if f in vision_config]
        values = {name: vision_config[name] for name in names}
        if "deepstack_visual_indexes" in values:
            values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
        return cls(**values)

    @classmethod
    def from_model_cfg(cls, model_cfg: ModelConfig) -> "Qwen3VisionConfig":
        """From ``model.vision`` / ``model.projector``, whose Qwen3-VL fields (``norm: layer``,
        ``num_position_embeddings``, ``deepstack_layers``) must be set."""
        vis, proj = model_cfg.vision, model_cfg.projector
        if vis is None or proj is None:
            raise ValueError("model.vision and model.projector must be set for a Qwen3-VL model")
        missing = [f"model.vision.{name}" for name in ("num_position_embeddings", "deepstack_layers")
                   if getattr(vis, name) in (None, [])]
        if missing:
            raise ValueError(f"{', '.join(missing)} must be set for a Qwen3-VL model (or pass the vision "
                             "facts to build_model as vision=Qwen3VisionConfig.from_hf(...))")
        if vis.norm != "layer":
            raise ValueError(f"model.vision.norm={vis.norm!r}: Qwen3-VL's vision blocks use LayerNorm (layer)")
        return cls(
            depth=vis.depth, hidden_size=vis.hidden_size, intermediate_size=vis.intermediate_size,
            num_heads=vis.num_heads, in_channels=vis.in_channels, patch_size=vis.patch_size,
            temporal_patch_size=vis.temporal_patch_size, spatial_merge_size=proj.spatial_merge_size,
            out_hidden_size=proj.out_hidden_size, num_position_embeddings=vis.num_position_embeddings,
            deepstack_visual_indexes=tuple(vis.deepstack_layers), hidden_act=vis.hidden_act,
        )


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
