"""LLaVA-OneVision's image processing ("anyres"): a single image becomes its base image (the whole
image resized to ``size``) followed by the crops of a higher-resolution canvas: the grid pinpoint
(height, width) that keeps the most of the image's pixels (then wastes the fewest) is filled by the
image resized to fit it, centred with black padding, and cut into ``size`` squares row by row. An
image sharing its sample with others is padded to a square in the mean colour instead, one square.

Its placeholder tokens (``anyres_tokens``): the base image's patches, then the canvas's patches
unpadded back to the image's proportions with one newline token per row, pooled down when they
exceed ``max_crops`` crops' worth (``anyres_max_9``). Bit for bit what transformers' LLaVA-OneVision
processor does with its PIL image processor (``tests/models/test_anyres_processor.py``).

Torch-free (numpy and PIL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import Grid, SquareImages
from loongforge.models.vlm.pixels import normalize, patch_rows, resize_bicubic

# llava-hf/llava-onevision-qwen2-*-ov-hf: SigLIP's normalisation, and the (height, width) canvases
# of 1 to 6 crops a side at 384 px.
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
PINPOINTS_384 = tuple((384 * rows, 384 * columns) for rows in range(1, 7) for columns in range(1, 7))


@dataclass(frozen=True)
class AnyresSettings:
    size: int = 384
    grid_pinpoints: tuple[tuple[int, int], ...] = PINPOINTS_384
    max_crops: int = 9  # ``vision_aspect_ratio="anyres_max_9"``
    mean: tuple[float, float, float] = SIGLIP_MEAN
    std: tuple[float, float, float] = SIGLIP_STD


def best_canvas(height: int, width: int, settings: AnyresSettings) -> tuple[int, int]:
    """The pinpoint (height, width) that keeps the most of the image's pixels, then wastes the fewest."""
    best, most_kept, least_wasted = None, 0, float("inf")
    for canvas_height, canvas_width in settings.grid_pinpoints:
        scale = min(canvas_width / width, canvas_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_width * canvas_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (canvas_height, canvas_width), kept, wasted
    return best


def fitted_size(height: int, width: int, canvas: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit ``canvas`` with its proportions."""
    canvas_height, canvas_width = canvas
    if canvas_width / width < canvas_height / height:
        return min(math.ceil(height * canvas_width / width), canvas_height), canvas_width
    return canvas_height, min(math.ceil(width * canvas_height / height), canvas_width)


def _normalized(pixels: np.ndarray, settings: AnyresSettings) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W] (``models.vlm.pixels.normalize``)."""
    return normalize(pixels, settings.mean, settings.std).transpose(2, 0, 1)


def anyres_crops(image: Image.Image, settings: AnyresSettings) -> np.ndarray:
    """A sample's only image -> float32 [1 + crops, 3, size, size]: the base image, then the crops."""
    size, canvas = settings.size, best_canvas(image.height, image.width, settings)
    fitted_height, fitted_width = fitted_size(image.height, image.width, canvas)
    top, left = (canvas[0] - fitted_height) // 2, (canvas[1] - fitted_width) // 2
    padded = np.zeros((canvas[0], canvas[1], 3), dtype=np.uint8)
    padded[top:top + fitted_height, left:left + fitted_width] = resize_bicubic(image, fitted_height, fitted_width)
    crops = [padded[row:row + size, column:column + size]
             for row in range(0, canvas[0], size) for column in range(0, canvas[1], size)]
    return np.stack([_normalized(square, settings) for square in [resize_bicubic(image, size, size), *crops]])


def square_padded(image: Image.Image, settings: AnyresSettings) -> np.ndarray:
    """An image sharing its sample with others -> float32 [1, 3, size, size]: centred on a square of
    its longer side filled with the mean colour, then resized."""
    side = max(image.height, image.width)
    square = np.empty((side, side, 3), dtype=np.uint8)
    square[:] = [int(value * 255) for value in settings.mean]
    top, left = (side - image.height) // 2, (side - image.width) // 2
    square[top:top + image.height, left:left + image.width] = np.asarray(image)
    return _normalized(resize_bicubic(Image.fromarray(square), settings.size, settings.size), settings)[None]


def anyres_tokens(height: int, width: int, settings: AnyresSettings, patch_size: int) -> int:
    """Placeholder tokens of a sample's only image: the base image's patches, then the canvas's,
    unpadded to the image's proportions, one newline a row, pooled down past ``max_crops`` crops."""
    side = settings.size // patch_size  # patches along a crop
    canvas = best_canvas(height, width, settings)
    rows, columns = side * (canvas[0] // settings.size), side * (canvas[1] // settings.size)
    if width / height > columns / rows:
        rows -= 2 * ((rows - int(round(height * (columns / width), 7))) // 2)
    else:
        columns -= 2 * ((columns - int(round(width * (rows / height), 7))) // 2)
    ratio = math.sqrt(rows * columns / (settings.max_crops * side**2))
    if ratio > 1.1:
        rows, columns = int(rows // ratio), int(columns // ratio)
    return side * side + rows * columns + rows


def anyres_settings(model_cfg: ModelConfig) -> AnyresSettings:
    """The processor's and the packing's anyres settings from ``model.vision``."""
    vis = model_cfg.vision
    return AnyresSettings(size=vis.image_size, grid_pinpoints=tuple(tuple(p) for p in vis.anyres.pinpoints),
                          max_crops=vis.anyres.max_crops, mean=tuple(vis.pixel_mean), std=tuple(vis.pixel_std))


@dataclass(frozen=True)
class AnyresImages(SquareImages):
    """LLaVA-OneVision's image processor (``ImageProcessing``): a sample's only image is its base
    square and the crops of its canvas, grid ``(1 + crops, side, side)``, ``anyres_tokens`` placeholders;
    an image sharing its sample is one padded square, ``side^2 + 1`` placeholders (its newline)."""

    settings: AnyresSettings
    patch_size: int

    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        if images_in_sample > 1:
            return (1, self.side, self.side), self.side**2 + 1
        canvas_height, canvas_width = best_canvas(height, width, self.settings)
        crops = (canvas_height // self.settings.size) * (canvas_width // self.settings.size)
        return (1 + crops, self.side, self.side), anyres_tokens(height, width, self.settings, self.patch_size)

    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        squares = anyres_crops(image, self.settings) if images_in_sample == 1 else square_padded(image, self.settings)
        return patch_rows(squares, self.patch_size), (squares.shape[0], self.side, self.side)

    def geometry(self) -> dict:
        return {"anyres_size": self.settings.size, "anyres_pinpoints": [list(p) for p in self.settings.grid_pinpoints],
                "anyres_max_crops": self.settings.max_crops}


def anyres_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> AnyresImages:
    """The run's LLaVA-OneVision processing (``ModelFamily.image_processing``)."""
    return AnyresImages(anyres_settings(model_cfg), model_cfg.vision.patch_size)
