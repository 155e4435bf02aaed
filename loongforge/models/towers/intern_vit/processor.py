"""InternVL's image processing: an image becomes tiles of ``size`` pixels (a grid of columns x rows
whose aspect ratio is the closest to the image's among ``min_tiles..max_tiles`` tiles, plus a
thumbnail of the whole image when there is more than one tile), each tile 256 placeholder tokens at
448 px (``(size / patch / 2)^2``). Bit for bit what transformers' InternVL processor does with its
PIL image processor (``GotOcr2ImageProcessorPil`` with ``crop_to_patches``): bicubic resize of the
uint8 image, rescale in float64, normalise in float32 (``tests/models/test_intern_vit_processor.py``).

Torch-free (numpy and PIL): the data side measures images with it before any model exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import Grid, SquareImages
from loongforge.models.vlm.pixels import normalize, patch_rows, resize_bicubic

# InternVL3.5's preprocessor_config.json: ImageNet's mean and std.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TileSettings:
    size: int = 448  # a tile's side in pixels (the tower's image_size)
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True  # a whole-image tile after the grid's, when the grid has more than one
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


@lru_cache(maxsize=16)
def _arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) with min..max tiles, fewest tiles first (ties in enumeration order)."""
    grids = [(columns, rows) for columns in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
             if min_tiles <= columns * rows <= max_tiles]
    return tuple(sorted(grids, key=lambda grid: grid[0] * grid[1]))


def tile_grid(width: int, height: int, settings: TileSettings) -> tuple[int, int]:
    """(columns, rows) of the tiles an image of ``width`` x ``height`` is resized to: the closest
    aspect ratio; on a tie the grid with more tiles while the image's area exceeds half the tiles'."""
    aspect, area = width / height, width * height
    best, best_difference = (1, 1), float("inf")
    for columns, rows in _arrangements(settings.min_tiles, settings.max_tiles):
        difference = abs(aspect - columns / rows)
        if difference < best_difference:
            best, best_difference = (columns, rows), difference
        elif difference == best_difference and area > 0.5 * settings.size * settings.size * columns * rows:
            best = (columns, rows)
    return best


def tile_count(width: int, height: int, settings: TileSettings) -> int:
    """Tiles of one image: the grid's, and the thumbnail when the grid has more than one."""
    columns, rows = tile_grid(width, height, settings)
    grid = columns * rows
    return grid + (1 if settings.thumbnail and grid > 1 else 0)


def tokens_per_tile(image_size: int, patch_size: int) -> int:
    """Placeholder tokens of one tile: its patches merged 2 x 2 by the pixel shuffle."""
    return (image_size // patch_size // 2) ** 2


def _normalized(pixels: np.ndarray, settings: TileSettings) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W] (``models.vlm.pixels.normalize``)."""
    return normalize(pixels, settings.mean, settings.std).transpose(2, 0, 1)


def preprocess_tiles(image: Image.Image, settings: TileSettings) -> np.ndarray:
    """An RGB image -> its tiles, float32 [tiles, 3, size, size], row by row, the thumbnail last."""
    columns, rows = tile_grid(image.width, image.height, settings)
    size = settings.size
    canvas = resize_bicubic(image, size * rows, size * columns)  # [rows * size, columns * size, 3]
    tiles = [canvas[row * size:(row + 1) * size, column * size:(column + 1) * size]
             for row in range(rows) for column in range(columns)]
    if settings.thumbnail and len(tiles) > 1:
        tiles.append(resize_bicubic(image, size, size))
    return np.stack([_normalized(tile, settings) for tile in tiles])


# The -HF tokenizer's image tokens; InternVLProcessor writes an image of n tiles as
# IMAGE_START + IMAGE_CONTEXT x (n x tokens per tile) + IMAGE_END.
IMAGE_START, IMAGE_CONTEXT, IMAGE_END = "<img>", "<IMG_CONTEXT>", "</img>"


def image_placeholder(num_tiles: int, tokens_per_tile: int = 256) -> str:
    """The text that stands for an image of ``num_tiles`` tiles in the prompt."""
    return IMAGE_START + IMAGE_CONTEXT * (num_tiles * tokens_per_tile) + IMAGE_END


@dataclass(frozen=True)
class TiledImages(SquareImages):
    """InternVL's image processor (``ImageProcessing``): an image is ``t`` tiles (the grid's and the
    thumbnail), its grid ``(t, side, side)`` in patches, ``t * side^2 / 4`` placeholder tokens."""

    settings: TileSettings
    patch_size: int

    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        tiles = tile_count(width, height, self.settings)
        return (tiles, self.side, self.side), tiles * tokens_per_tile(self.settings.size, self.patch_size)

    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        tiles = preprocess_tiles(image, self.settings)  # [t, 3, S, S]
        return patch_rows(tiles, self.patch_size), (tiles.shape[0], self.side, self.side)

    def geometry(self) -> dict:
        return {"tile_size": self.settings.size, "max_tiles": self.settings.max_tiles}


def tiled_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> TiledImages:
    """The run's InternVL processing: tiles of ``model.vision.image_size`` pixels, at most
    ``data.max_tiles`` of them, the tower's normalisation (``TowerPart.images``)."""
    vis = model_cfg.vision
    settings = TileSettings(size=vis.image_size, max_tiles=data_cfg.max_tiles, mean=tuple(vis.pixel_mean),
                            std=tuple(vis.pixel_std))
    return TiledImages(settings, vis.patch_size)
