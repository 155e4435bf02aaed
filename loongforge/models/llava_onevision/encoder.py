"""LLaVA-OneVision's vision part: SigLIP and the MLP projector (``models/towers/siglip``) with the anyres
packing and its learned newline vector on top, as one ``VisionEncoder`` that reads each image whole: its
features follow the image's size (``packing.pack_anyres``)."""

from __future__ import annotations

from typing import Optional

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.llava_onevision.anyres import anyres_settings, anyres_tokens
from loongforge.models.llava_onevision.packing import pack_anyres
from loongforge.models.media import MediaSet
from loongforge.models.towers.siglip.encoder import SiglipEncoder, build_parts
from loongforge.models.towers.siglip.vision import MLPProjector, VisionModel
from loongforge.models.vlm.encoder import EncoderBuild


class ImageNewline(torch.nn.Module):
    """The learned vector after each row of an image's crop features (transformers' ``image_newline``)."""

    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(width, dtype=dtype))


class LlavaOnevisionEncoder(SiglipEncoder):
    """An image set (rows [squares * side^2, C*p*p], one grid (squares, side, side) and one size per image)
    -> the images' packed features [tokens, LM hidden]: an image of one square (sharing its sample) is its
    patches and a newline; a single image its base square and its crops."""

    projector_parts = ("projector", "image_newline")
    reads_items = True

    def __init__(self, vision_model: VisionModel, projector: MLPProjector, image_newline: ImageNewline,
                 model_cfg: ModelConfig):
        super().__init__(vision_model, projector, model_cfg)
        self.image_newline = image_newline
        self.settings = anyres_settings(model_cfg)
        self.patch_size = model_cfg.vision.patch_size

    @classmethod
    def build(cls, build: EncoderBuild) -> "LlavaOnevisionEncoder":
        width = build.model_cfg.projector.out_hidden_size
        made = build_parts(build, image_newline=lambda: ImageNewline(width, build.params_dtype))
        return cls(made["vision_model"], made["projector"], made["image_newline"], build.model_cfg)

    @classmethod
    def feature_rows(cls, model_cfg: ModelConfig, images: Optional[MediaSet], merge_unit: int) -> Optional[int]:
        if images is None:
            return 0
        settings, patch = anyres_settings(model_cfg), model_cfg.vision.patch_size
        side = settings.size // patch
        return sum(side * side + 1 if int(squares) == 1 else anyres_tokens(int(h), int(w), settings, patch)
                   for (squares, _, _), (h, w) in zip(images.grids.tolist(), _sizes(images).tolist()))

    def encode_images(self, images: MediaSet) -> torch.Tensor:
        """Each image's packed features, image after image [tokens, LM hidden]."""
        squares = images.grids[:, 0]
        features = self(images.rows, images.grids)  # [squares * side^2, h]
        per_square = features.view(int(squares.sum()), -1, features.shape[-1])
        packed = [pack_anyres(image, (int(h), int(w)), self.image_newline.weight, self.settings, self.patch_size)
                  for image, (h, w) in zip(per_square.split(squares.tolist()), _sizes(images).tolist())]
        return torch.cat(packed)


def _sizes(images: MediaSet) -> torch.Tensor:
    if images.sizes is None:
        raise ValueError("LLaVA-OneVision packs each image's features by its size: the images carry none "
                         "(a folder packed before sizes were kept); pack it again with this loongforge")
    return images.sizes  # [n, 2]
