"""SigLIP's own image processing: every image resized (bicubic) to one square of ``model.vision.image_size``
pixels, normalised with ``model.vision.pixel_mean`` / ``pixel_std``, one token per patch: grid
``(1, side, side)``, ``side^2`` placeholders. What a composition of SigLIP with any decoder sees; a VLM
with a processor of its own (LLaVA-OneVision's anyres) gives that instead (``ModelFamily.image_processing``).

Torch-free (numpy and PIL).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import Grid, SquareImages
from loongforge.models.vlm.pixels import normalize, patch_rows, resize_bicubic


@dataclass(frozen=True)
class SquareSettings:
    size: int  # the square's side in pixels
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass(frozen=True)
class ResizedSquares(SquareImages):
    """An image -> one ``size`` x ``size`` square, whatever its proportions (``ImageProcessing``)."""

    settings: SquareSettings
    patch_size: int

    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        return (1, self.side, self.side), self.side**2

    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        size = self.settings.size
        square = normalize(resize_bicubic(image, size, size), self.settings.mean, self.settings.std)  # [S, S, 3]
        return patch_rows(square.transpose(2, 0, 1)[None], self.patch_size), (1, self.side, self.side)

    def geometry(self) -> dict:
        return {"square_size": self.settings.size}


def square_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> ResizedSquares:
    """The run's SigLIP processing (``TowerPart.images``)."""
    vis = model_cfg.vision
    return ResizedSquares(SquareSettings(vis.image_size, tuple(vis.pixel_mean), tuple(vis.pixel_std)), vis.patch_size)
