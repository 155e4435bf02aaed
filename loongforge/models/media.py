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

A processor may also give an image facts of its own (``ImagePlan.facts``, ``ImageProcessing.facts``:
small numbers by name) that its tower reads; they travel with the image through packing, the packed
folder, collate and the step to the tower without any other module knowing their names.

The model side of the contract is ``MediaBatch``: a micro-batch's media as typed items (``MediaItem``:
modality, patch rows, grid, size, facts), held per modality as one ``MediaSet`` of stacked tensors so
that a tower reads them whole. collate builds it, the step moves it, the model and ``encode`` read it, and
a family's ``hf_model_inputs`` turns it into its transformers class's arguments.

Torch-free at import (numpy and PIL): images are measured before any model exists; a ``MediaBatch``
holds tensors that its caller made.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

Grid = tuple[int, int, int]
# A processor's own facts about one image, by name: numbers or short tuples of numbers (JSON values).
Facts = Mapping[str, Any]


@dataclass(frozen=True)
class ImagePlan:
    grid: Grid  # (t, h, w): t squares of h x w patches, encoded each on its own
    tokens: int  # placeholder tokens the image takes in the text
    size: tuple[int, int] = (0, 0)  # (height, width) of the image in pixels
    facts: Facts = field(default_factory=dict)  # the processor's own facts about it (``ImageProcessing.facts``)


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
        return ImagePlan(grid=grid, tokens=tokens, size=(height, width),
                         facts=self.facts(width, height, images_in_sample))

    def facts(self, width: int, height: int, images_in_sample: int) -> Facts:
        """Facts of its own about an image of ``width`` x ``height`` pixels that its tower reads ({}: none);
        they reach the tower as ``MediaSet.facts``, one tensor per name."""
        return {}

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


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a micro-batch, as a view into its ``MediaSet``."""

    modality: str  # "image" | "video"
    rows: Optional["torch.Tensor"]  # [t*h*w, patch_dim] its patch rows; None where features are stored
    grid: Grid  # (t, h, w) in patches
    size: Optional[tuple[int, int]]  # (height, width) in pixels; None where not kept
    facts: Facts  # the processor's own facts about it (``ImagePlan.facts``)


@dataclass(frozen=True)
class MediaSet:
    """One modality's media in a micro-batch, item after item in the order of their placeholders in the
    text, stacked: what a tower reads whole."""

    grids: "torch.Tensor"  # [n, 3] long: (t, h, w) in patches per item
    rows: Optional["torch.Tensor"] = None  # [sum t*h*w, patch_dim] patch rows; None: ``features`` instead
    # [sum tokens, width]: the encoder's features computed offline (``data.vision_embeddings``)
    features: Optional["torch.Tensor"] = None
    sizes: Optional["torch.Tensor"] = None  # [n, 2] long (height, width) in pixels; None where not kept
    # The processor's own facts, each [n, ...]: its tower reads them (names only it and its processor know).
    facts: Mapping[str, "torch.Tensor"] = field(default_factory=dict)
    samples: tuple[int, ...] = ()  # per item, the index in the row of its sample

    def __len__(self) -> int:
        return len(self.grids)

    @property
    def patches(self) -> list[int]:
        """Patch rows per item."""
        return [t * h * w for t, h, w in self.grids.tolist()]

    def to(self, device, non_blocking: bool = False) -> "MediaSet":
        """The set on ``device`` (the step's copy to the compute device)."""
        def moved(tensor):
            return None if tensor is None else tensor.to(device, non_blocking=non_blocking)

        return replace(self, grids=moved(self.grids), rows=moved(self.rows), features=moved(self.features),
                       sizes=moved(self.sizes), facts={name: moved(value) for name, value in self.facts.items()})

    def items(self, modality: str) -> Iterator[MediaItem]:
        """Each item as a view (its rows a slice of ``rows``)."""
        rows = [None] * len(self) if self.rows is None else self.rows.split(self.patches)
        sizes = [None] * len(self) if self.sizes is None else [tuple(size) for size in self.sizes.tolist()]
        for index, (grid, item_rows, size) in enumerate(zip(self.grids.tolist(), rows, sizes)):
            yield MediaItem(modality=modality, rows=item_rows, grid=tuple(grid), size=size,
                            facts={name: value[index] for name, value in self.facts.items()})


@dataclass(frozen=True)
class MediaBatch:
    """A micro-batch's media: its images, then its videos (each None where it has none)."""

    images: Optional[MediaSet] = None
    videos: Optional[MediaSet] = None

    def __bool__(self) -> bool:
        return self.images is not None or self.videos is not None

    def to(self, device, non_blocking: bool = False) -> "MediaBatch":
        return MediaBatch(images=None if self.images is None else self.images.to(device, non_blocking),
                          videos=None if self.videos is None else self.videos.to(device, non_blocking))

    def items(self) -> Iterator[MediaItem]:
        """Every item: the images, then the videos."""
        for modality, media in (("image", self.images), ("video", self.videos)):
            if media is not None:
                yield from media.items(modality)

    def grids(self, modality: str) -> Optional["torch.Tensor"]:
        return self._field(modality, "grids")

    def rows(self, modality: str) -> Optional["torch.Tensor"]:
        return self._field(modality, "rows")

    def features(self, modality: str) -> Optional["torch.Tensor"]:
        return self._field(modality, "features")

    def _field(self, modality: str, name: str) -> Optional["torch.Tensor"]:
        """One field of the ``modality`` ("image" | "video") set; None where the batch holds none of it."""
        media = self.images if modality == "image" else self.videos
        return None if media is None else getattr(media, name)

    @classmethod
    def of(cls, *, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
           image_embeds=None, video_embeds=None, image_sizes=None, second_per_grid_ts=None) -> "MediaBatch":
        """A batch from tensors under transformers' processor names (a test's or a benchmark's inputs)."""
        images = None if image_grid_thw is None else MediaSet(
            grids=image_grid_thw, rows=pixel_values, features=image_embeds, sizes=image_sizes)
        videos = None if video_grid_thw is None else MediaSet(
            grids=video_grid_thw, rows=pixel_values_videos, features=video_embeds,
            facts={} if second_per_grid_ts is None else {SECONDS_PER_GRID_T: second_per_grid_ts})
        return cls(images=images, videos=videos)


# A video's fact: seconds per temporal patch (``data.vision.VideoPlan.second_per_grid_t``).
SECONDS_PER_GRID_T = "second_per_grid_t"
