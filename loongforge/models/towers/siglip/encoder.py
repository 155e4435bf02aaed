"""LLaVA-OneVision's vision part: SigLIP, the MLP projector and the anyres packing with its newline
vector as one ``VisionEncoder`` whose features per image follow its size (``packs_media``)."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import layer_norm_modules
from loongforge.models.towers.siglip.packing import pack_anyres
from loongforge.models.towers.siglip.processor import anyres_settings, anyres_tokens
from loongforge.models.towers.siglip.vision import MLPProjector, VisionModel
from loongforge.models.vlm.vision_configs import (
    layer_norm_vit_config,
    to_language_width_config,
)
from loongforge.models.vlm.encoder import EncoderBuild, VisionEncoder, seeded_parts


def check(model_cfg: ModelConfig) -> None:
    """The settings SigLIP is built from, each a ValueError naming the key."""
    vis = model_cfg.vision
    if vis.image_size is None or vis.image_size < vis.patch_size:
        raise ValueError(f"model.vision.image_size={vis.image_size}: SigLIP needs the image side in pixels "
                         "(384 for LLaVA-OneVision)")
    if vis.norm != "layer":
        raise ValueError(f"model.vision.norm={vis.norm!r}: SigLIP's blocks use LayerNorm (layer)")
    if model_cfg.projector.spatial_merge_size != 1:
        raise ValueError(f"model.projector.spatial_merge_size={model_cfg.projector.spatial_merge_size}: LLaVA's "
                         "projector maps every patch to a token; set it to 1")


class ImageNewline(torch.nn.Module):
    """The learned vector after each row of an image's crop features (transformers' ``image_newline``)."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width, dtype=dtype))


class LlavaOnevisionEncoder(VisionEncoder):
    """pixel rows [squares * side^2, C*p*p] + one grid (squares, side, side) per image + image sizes ->
    the images' packed features [tokens, LM hidden] (``packing.pack_anyres``): an image of one square
    (sharing its sample) is its patches and a newline; a single image its base square and its crops."""

    projector_parts = ("projector", "image_newline")
    packs_media = True

    def __init__(self, vision_model: VisionModel, projector: MLPProjector, image_newline: ImageNewline,
                 model_cfg: ModelConfig):
        super().__init__(merge_unit=1, out_hidden=model_cfg.projector.out_hidden_size)
        self.vision_model = vision_model
        self.projector = projector
        self.image_newline = image_newline
        self.settings = anyres_settings(model_cfg)
        self.patch_size = model_cfg.vision.patch_size

    @classmethod
    def build(cls, build: EncoderBuild) -> "LlavaOnevisionEncoder":
        model_cfg, tp, dtype, on_cpu = build.model_cfg, build.vision_tp, build.params_dtype, build.on_cpu
        check(model_cfg)
        # no_mask: bidirectional inside each image; TE maps it to "padding" for packed input.
        layer_spec = transformer_layer_spec(layer_norm_modules(build.modules), AttnMaskType.no_mask)
        vision_config = layer_norm_vit_config(model_cfg, tp, dtype, on_cpu, recompute=build.recompute)
        projector_config = to_language_width_config(model_cfg, tp, dtype, on_cpu)
        made = seeded_parts(build.init_seed,
                            vision_model=lambda: VisionModel(vision_config, model_cfg, layer_spec, build.pgs),
                            projector=lambda: MLPProjector(projector_config, model_cfg, build.tp_group, build.modules),
                            image_newline=lambda: ImageNewline(model_cfg.projector.out_hidden_size, dtype))
        return cls(made["vision_model"], made["projector"], made["image_newline"], model_cfg)

    @classmethod
    def feature_rows(cls, model_cfg: ModelConfig, grid_thw: Optional[torch.Tensor],
                     image_sizes: Optional[torch.Tensor], merge_unit: int) -> Optional[int]:
        if grid_thw is None:
            return 0
        if image_sizes is None or len(image_sizes) != len(grid_thw):
            raise ValueError("LLaVA-OneVision's images need image_sizes [n, 2], one (height, width) per image grid")
        settings, patch = anyres_settings(model_cfg), model_cfg.vision.patch_size
        side = settings.size // patch
        return sum(side * side + 1 if int(squares) == 1 else anyres_tokens(int(h), int(w), settings, patch)
                   for (squares, _, _), (h, w) in zip(grid_thw.tolist(), image_sizes.tolist()))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                image_sizes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Without ``image_sizes``: every square's features, unpacked [squares * side^2, LM hidden]
        (``loongforge encode``'s rows); with them, each image's packed features."""
        squares = grid_thw[:, 0]
        features = self.projector(self.vision_model(pixel_values, grid_thw))  # [squares * side^2, h]
        if image_sizes is None:
            return features
        per_square = features.view(int(squares.sum()), -1, features.shape[-1])
        packed = [pack_anyres(image, (int(h), int(w)), self.image_newline.weight, self.settings, self.patch_size)
                  for image, (h, w) in zip(per_square.split(squares.tolist()), image_sizes.tolist())]
        return torch.cat(packed)
