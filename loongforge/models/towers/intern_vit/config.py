"""InternViT's shape in transformers' words: ``InternViTConfig`` reads and writes the ``vision_config``
of an ``InternVLForConditionalGeneration`` config.json (``InternVLVisionConfig``'s field names), plus
the composition's ``downsample_ratio``; the published InternVL3.5 vision towers as constants.

Torch-free: the parameter and FLOP counts and the config checks import it without megatron-core.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from loongforge.config.schema import ProjectorConfig, VisionConfig
from loongforge.models.towers.intern_vit.processor import IMAGENET_MEAN, IMAGENET_STD

# transformers' spellings of the two norms InternViT is published with.
NORM_TYPES = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class InternViTConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    # Tiles are square: one side in pixels, and the patch side (a Conv2d with kernel = stride).
    image_size: int = 448
    patch_size: int = 14
    num_channels: int = 3
    hidden_act: str = "gelu"
    norm_type: str = "layer_norm"  # InternViT-300M; InternViT-6B uses rms_norm
    layer_norm_eps: float = 1e-6
    # q, k, v biases (the output projection always has one). Defaults are transformers' (False
    # here), so that a config.json that omits a key reads as transformers reads it.
    attention_bias: bool = False
    use_qk_norm: bool = False  # a norm of norm_type over all heads of q and of k (InternViT-6B)
    # lambda_1 / lambda_2 start at this value; a trained checkpoint overrides them.
    layer_scale_init_value: float = 0.1
    # True: the tower's last hidden state is not normed (transformers' Identity), which is what
    # InternVL feeds the projector; the pooled output is never used by the VLM.
    use_mean_pooling: bool = True
    # The pixel shuffle: 0.5 merges 2 x 2 patches into one token of 4x the width.
    downsample_ratio: float = 0.5
    projector_hidden_act: str = "gelu"
    # -1: the last layer's output feeds the projector (InternVL3.5's vision_feature_layer).
    vision_feature_layer: int = -1

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_factor(self) -> int:
        """Patches along a side merged into one token (2 at downsample 0.5)."""
        return round(1 / self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        """Language-model tokens one tile becomes (256 for 448-pixel tiles at downsample 0.5)."""
        return (self.patches_per_side // self.merge_factor) ** 2

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any], where: str = "vision_config", *,
                downsample_ratio: float = 0.5, projector_hidden_act: str = "gelu",
                vision_feature_layer: int = -1) -> "InternViTConfig":
        """From an HF ``vision_config`` dict (the composition's three keys passed apart, as they sit
        one level up in config.json); ``where`` names the dict in errors ("config.json vision_config")."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: vision_config[key] for key in known if key in vision_config}
        for key in ("image_size", "patch_size"):
            if key in values:
                values[key] = _square(values[key], f"{where}.{key}")
        values.update(downsample_ratio=downsample_ratio, projector_hidden_act=projector_hidden_act,
                      vision_feature_layer=vision_feature_layer)
        config = cls(**values)
        config.check(where)
        return config

    def to_hf(self) -> dict:
        """The HF ``vision_config`` dict (the composition's keys stay with the caller)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("downsample_ratio", "projector_hidden_act", "vision_feature_layer")}
        out.update(image_size=[self.image_size] * 2, patch_size=[self.patch_size] * 2,
                   model_type="internvl_vision")
        return out

    def check(self, where: str = "vision_config") -> None:
        """Every value this tower can be built with, else a ValueError naming ``where``.key."""
        def fail(key: str, why: str) -> None:
            raise ValueError(f"{where}.{key}={getattr(self, key)!r}: {why}")

        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "image_size", "patch_size", "num_channels"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                fail(key, "must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            fail("num_attention_heads", f"must divide hidden_size={self.hidden_size}")
        if self.image_size % self.patch_size:
            fail("image_size", f"must be a multiple of patch_size={self.patch_size}")
        if self.norm_type not in NORM_TYPES:
            fail("norm_type", f"InternViT is built with one of {NORM_TYPES}")
        if self.hidden_act != "gelu" or self.projector_hidden_act != "gelu":
            key = "hidden_act" if self.hidden_act != "gelu" else "projector_hidden_act"
            fail(key, "InternVL's MLPs use the exact (erf) gelu")
        if not self.use_mean_pooling:
            fail("use_mean_pooling", "a final LayerNorm before the projector is not built (InternVL3.5 has none)")
        if self.downsample_ratio != 0.5:
            fail("downsample_ratio", "the pixel shuffle is built for 0.5 (2 x 2 patches per token)")
        if self.patches_per_side % self.merge_factor:
            fail("image_size", f"needs an even number of patches a side, has {self.patches_per_side}")
        if self.vision_feature_layer != -1:
            fail("vision_feature_layer", "InternVL3.5 feeds the last layer's output (-1) to the projector")
        if not self.layer_norm_eps > 0:
            fail("layer_norm_eps", "must be positive")

    @classmethod
    def from_schema(cls, vision: VisionConfig, projector: ProjectorConfig) -> "InternViTConfig":
        """The tower a run's ``model.vision`` / ``model.projector`` build."""
        return cls(hidden_size=vision.hidden_size, num_hidden_layers=vision.depth, num_attention_heads=vision.num_heads,
                   intermediate_size=vision.intermediate_size, image_size=vision.image_size,
                   patch_size=vision.patch_size, num_channels=vision.in_channels, hidden_act=vision.hidden_act,
                   norm_type="layer_norm" if vision.norm == "layer" else "rms_norm",
                   layer_norm_eps=vision.rms_norm_eps, attention_bias=vision.qkv_bias, use_qk_norm=vision.qk_norm,
                   downsample_ratio=1 / projector.spatial_merge_size, projector_hidden_act=projector.hidden_act)

    def to_schema(self, text_hidden_size: int, where: str = "vision_config") -> tuple[VisionConfig, ProjectorConfig]:
        """``model.vision`` and ``model.projector`` of a run that builds this tower."""
        vision = VisionConfig(
            arch="intern_vit", depth=self.num_hidden_layers, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_heads=self.num_attention_heads,
            in_channels=self.num_channels, patch_size=self.patch_size, temporal_patch_size=1,
            image_size=self.image_size, window=None,
            rms_norm_eps=self.layer_norm_eps, hidden_act=self.hidden_act,
            norm="layer" if self.norm_type == "layer_norm" else "rms", qkv_bias=self.attention_bias,
            qk_norm=self.use_qk_norm,
            pixel_mean=list(IMAGENET_MEAN), pixel_std=list(IMAGENET_STD))
        projector = ProjectorConfig(arch="pixel_shuffle_mlp", spatial_merge_size=self.merge_factor,
                                    hidden_act=self.projector_hidden_act, out_hidden_size=text_hidden_size)
        return vision, projector


def _square(value: Any, where: str) -> int:
    """An HF size given as an int or as [height, width] with height == width."""
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1] and isinstance(value[0], int):
        return value[0]
    raise ValueError(f"{where}={value!r}: InternViT's tiles are square; give one int or [n, n]")


# InternVL3.5-8B-HF: InternViT-300M (v2.5) beside Qwen3-8B, whose width (4096) the projector writes.
INTERNVL3_5_8B_VISION = InternViTConfig(attention_bias=True)
INTERNVL3_5_8B_TEXT_HIDDEN = 4096

# InternVL3.5-38B-HF: InternViT-6B (v2.5) beside Qwen3-32B (width 5120): RMSNorm, q/k norm, no qkv bias.
INTERNVL3_5_38B_VISION = InternViTConfig(
    hidden_size=3200, num_hidden_layers=45, num_attention_heads=25, intermediate_size=12800,
    norm_type="rms_norm", attention_bias=False, use_qk_norm=True)
INTERNVL3_5_38B_TEXT_HIDDEN = 5120
