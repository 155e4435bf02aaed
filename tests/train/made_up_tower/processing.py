"""The made-up tower's image processor: any image resized (bicubic) to one square of ``image_size``
pixels, normalised with CLIP's mean and std, cut into patches row-major: grid (1, side, side), one
placeholder token per patch. Its fact of its own about each image: ``wide`` (1 where the image is at least
1.7 times wider than tall, else 0), which the encoder reads. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import Grid, ImageProcessing
from loongforge.models.vlm.pixels import normalize, patch_rows, resize_bicubic


WIDE = "wide"  # the per-image fact: the squashed image was at least 1.7 times wider than tall


@dataclass(frozen=True)
class SquashedSquare(ImageProcessing):
    image_size: int
    patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        return (1, self.side, self.side), self.side**2

    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        square = normalize(resize_bicubic(image, self.image_size, self.image_size), self.mean, self.std)
        rows = patch_rows(square.transpose(2, 0, 1)[None], self.patch_size)  # [side^2, 3*p*p]
        return rows, (1, self.side, self.side)

    def facts(self, width: int, height: int, images_in_sample: int) -> dict:
        return {WIDE: int(width >= 1.7 * height)}

    def geometry(self) -> dict:
        return {"image_size": self.image_size}


def square_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> SquashedSquare:
    """``TowerPart.images``: the processor at the run's settings."""
    vision = model_cfg.vision
    return SquashedSquare(vision.image_size, vision.patch_size, tuple(vision.pixel_mean), tuple(vision.pixel_std))
