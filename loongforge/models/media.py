"""The media interface between the data pipeline and a vision tower: how the tower's processor turns
one image into patch rows and placeholder tokens (``ImageProcessing``), and how a family's processor samples,
sizes and patches a video (``VideoProcessing``).

Every tower part (``models.parts.TowerPart.images``) gives an ``ImageProcessing`` built from the run's
model and data settings; the data side (``data.measure``) asks it, per image:

- ``plan(width, height, images_in_sample)``, from the header alone (no pixel decoded): the image's
  grid ``(t, h, w)`` in patches, ``t`` squares of ``h x w`` patches (Qwen's smart-resized image:
  ``t = 1``; InternVL's tiles and thumbnail; LLaVA-OneVision's base image and anyres crops), and its
  placeholder tokens in the text;
- ``pixels(image, images_in_sample)``, after decoding: the patch rows ``[t*h*w, patch_dim]`` in the
  order the tower reads them, and the grid they make (which must be the planned one).

The grid is what the rest of the pipeline and the model see of an image (packing, balancing's cost,
``encoder_dp``, ``encoder_cp``, the FLOP count); ``images_in_sample`` is there because some processors
treat an image differently when it shares its sample with others (LLaVA-OneVision pads it to one
square instead of tiling it).

Torch-free (numpy and PIL): images are measured before any model exists.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ImagePlan:
    grid: Grid  # (t, h, w): t squares of h x w patches, encoded each on its own
    tokens: int  # placeholder tokens the image takes in the text
    size: tuple[int, int] = (0, 0)  # (height, width) of the image in pixels


class ImageProcessing(abc.ABC):
    """One tower's image processor at a run's settings (a frozen, picklable value)."""

    @property
    @abc.abstractmethod
    def patch_dim(self) -> int:
        """Values in one patch row (``C * [temporal] * p * p``)."""

    def plan(self, width: int, height: int, images_in_sample: int = 1) -> ImagePlan:
        """The grid, placeholder tokens and size of an image of ``width`` x ``height`` pixels; ValueError
        for an image the processor cannot take (an extreme aspect ratio)."""
        grid, tokens = self.grid_and_tokens(width, height, images_in_sample)
        return ImagePlan(grid=grid, tokens=tokens, size=(height, width))

    @abc.abstractmethod
    def grid_and_tokens(self, width: int, height: int, images_in_sample: int) -> tuple[Grid, int]:
        """(grid, placeholder tokens) of an image of ``width`` x ``height`` pixels (``plan``'s)."""

    @abc.abstractmethod
    def pixels(self, image: Image.Image, images_in_sample: int = 1) -> tuple[np.ndarray, Grid]:
        """An RGB image -> (float32 patch rows [t*h*w, patch_dim], its grid)."""

    def geometry(self) -> dict:
        """The settings beyond the patch geometry that decide grids and token counts, which a packed
        folder records and a run must agree on ({}: none)."""
        return {}


class SquareImages(ImageProcessing):
    """A processing that cuts every image into squares of ``settings.size`` pixels (InternVL's tiles,
    LLaVA-OneVision's crops): each square ``side x side`` patches of ``patch_size``, RGB. A subclass is a
    frozen dataclass with ``settings`` and ``patch_size``."""

    settings: Any
    patch_size: int

    @property
    def side(self) -> int:
        return self.settings.size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2


class VideoProcessing(abc.ABC):
    """A processor's video rule (a family's, ``ChatFormat.video_rule``): which frames of a clip it
    samples, the size it gives them and the patch rows they make. Stateless: the run's patch geometry
    and pixel budgets come as arguments (``data.vision.VisionSizing`` holds them). A frozen, picklable
    value; the data side (``data.vision.plan_video``) asks it per video."""

    # Its name where a packed folder or embedding store records it (``geometry``, ``VisionSizing.settings``).
    name: str

    @abc.abstractmethod
    def frame_indices(self, num_frames: int, native_fps: float, target_fps: float, max_frames: int,
                      temporal_patch_size: int) -> list[int]:
        """Decode-order indices of the frames sampled from a clip of ``num_frames`` at ``native_fps``."""

    @abc.abstractmethod
    def frame_size(self, num_sampled: int, height: int, width: int, temporal_patch_size: int, factor: int,
                   min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """(height, width) every sampled frame is resized to, multiples of ``factor`` (patch x merge);
        ValueError for a clip the processor cannot take (an extreme aspect ratio)."""

    @abc.abstractmethod
    def patch_rows(self, frames: np.ndarray, temporal_patch_size: int, patch_size: int,
                   merge_size: int) -> np.ndarray:
        """Normalised frames float32 [T, H, W, 3] (T a multiple of ``temporal_patch_size``) -> patch rows
        [T/tp * H/p * W/p, 3*tp*p*p] in the order the tower reads them."""

    def geometry(self) -> dict:
        """What a packed folder records of the rule ({}: the rule folders followed before one was recorded)."""
        return {"video_rule": self.name}
