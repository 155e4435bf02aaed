"""Qwen3-VL's vision facts (``Qwen3VisionConfig``): the ViT, its merger and the DeepStack mergers.

``Qwen3VisionConfig`` holds every vision fact this family reads, built from transformers'
``vision_config`` (``from_hf``) or from a ``ModelConfig`` (``from_model_cfg``). Plain arithmetic, no
megatron-core: the weight map and the HF config read it without importing the model code; the
towers' megatron configs are ``configs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from loongforge.config.schema import ModelConfig

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
        # deepstack_layers may be empty: Qwen3.5 composes the tower without DeepStack.
        missing = [f"model.vision.{name}" for name in ("num_position_embeddings",) if getattr(vis, name) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} must be set for a Qwen3-VL model (or pass the vision "
                             "facts to build_model as vision=Qwen3VisionConfig.from_hf(...))")
        if vis.norm != "layer":
            raise ValueError(f"model.vision.norm={vis.norm!r}: Qwen3-VL's vision blocks use LayerNorm (layer)")
        if vis.qk_norm or not vis.qkv_bias:
            raise ValueError("model.vision.qk_norm / qkv_bias: Qwen3-VL's vision blocks have q, k, v biases and no "
                             "q/k norm; leave them at false / true")
        return cls(
            depth=vis.depth, hidden_size=vis.hidden_size, intermediate_size=vis.intermediate_size,
            num_heads=vis.num_heads, in_channels=vis.in_channels, patch_size=vis.patch_size,
            temporal_patch_size=vis.temporal_patch_size, spatial_merge_size=proj.spatial_merge_size,
            out_hidden_size=proj.out_hidden_size, num_position_embeddings=vis.num_position_embeddings,
            deepstack_visual_indexes=tuple(vis.deepstack_layers), hidden_act=vis.hidden_act,
        )
