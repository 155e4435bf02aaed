"""The Qwen-VL towers' image processing (Qwen2-VL's processor, used by Qwen2.5-VL and Qwen3-VL): bit-equal
to transformers' ``Qwen2VLImageProcessorPil`` with default arguments.

RGB -> ``smart_resize`` to multiples of ``patch x merge`` pixels inside [min_pixels, max_pixels] ->
PIL bicubic resize -> ``x * (1/255)`` in float64, cast to float32 -> ``(x - mean) / std`` in float32
-> ``patchify``. A still image is repeated over the temporal slots; its grid is ``(1, h, w)`` and it
takes ``h * w / merge^2`` placeholder tokens.

Patch row layout: ``[grid_t*grid_h*grid_w, C*temporal*p*p]``; rows are ordered (t, h-block, w-block,
h-in-block, w-in-block) with merge x merge blocks, so every merge^2 consecutive rows are one merged
token; each row is (C, temporal, p, p) flattened. Videos (``video.py``) use the same resize rule and
the same layout.

Torch-free (numpy and PIL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import Grid, ImageProcessing
from loongforge.models.vlm.pixels import normalize, resize_bicubic

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor`` with area in [min_pixels, max_pixels],
    keeping the aspect ratio as closely as possible (Qwen2-VL's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds 200")
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    if resized_h * resized_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        resized_h = max(factor, math.floor(height / scale / factor) * factor)
        resized_w = max(factor, math.floor(width / scale / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * scale / factor) * factor
        resized_w = math.ceil(width * scale / factor) * factor
    return resized_h, resized_w


def patchify(frames: np.ndarray, temporal_patch: int, patch: int, merge: int) -> np.ndarray:
    """float32 [T, H, W, C] (T a multiple of ``temporal_patch``) -> [T/tp * H/p * W/p, C*tp*p*p]."""
    num_frames, height, width, channels = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch, height // patch, width // patch
    blocks = frames.reshape(grid_t, temporal_patch, grid_h // merge, merge, patch, grid_w // merge, merge, patch,
                            channels)
    # -> (t, h-block, w-block, h-in-block, w-in-block, C, tp, py, px)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(blocks).reshape(grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch)


@dataclass(frozen=True)
class SmartResizeImages(ImageProcessing):
    """Qwen2-VL's image processor at a run's sizes (``ImageProcessing``)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        resized_h, resized_w = self._resized(width, height)
        grid = (1, resized_h // self.patch_size, resized_w // self.patch_size)
        return grid, grid[1] * grid[2] // self.merge_size**2

    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        resized_h, resized_w = self._resized(*image.size)
        frame = normalize(resize_bicubic(image, resized_h, resized_w), self.mean, self.std)  # [H, W, 3]
        frames = np.repeat(frame[None], self.temporal_patch_size, axis=0)  # [tp, H, W, 3]
        rows = patchify(frames, self.temporal_patch_size, self.patch_size, self.merge_size)
        return rows, (1, resized_h // self.patch_size, resized_w // self.patch_size)

    def geometry(self) -> dict:
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}


def smart_resize_images(model_cfg: ModelConfig, data_cfg: DataConfig) -> SmartResizeImages:
    """The run's Qwen-VL image processing: the tower's patch geometry and normalisation, the data's
    pixel budget (``TowerPart.images``)."""
    vis = model_cfg.vision
    return SmartResizeImages(vis.patch_size, vis.temporal_patch_size, model_cfg.projector.spatial_merge_size,
                             data_cfg.min_pixels, data_cfg.max_pixels, tuple(vis.pixel_mean), tuple(vis.pixel_std))
