"""The Qwen-VL processors' video rules (``models.media.VideoProcessing``): how frames are sampled from a
clip and sized, per family (``ChatFormat.video_rule``). Both patchify like the images
(``smart_resize.patchify``); ``data.vision`` decodes, resizes (PIL bicubic) and normalises the frames.

- ``QWEN2_VL_VIDEO`` (Qwen2-VL, Qwen2.5-VL): frames at ``video_fps`` (at most ``video_max_frames``, at
  least 4 when the video has them, an even count); each frame sized by ``smart_resize`` with
  ``video_min_pixels`` / ``video_max_pixels`` per frame.
- ``QWEN3_VL_VIDEO`` (transformers' Qwen3VLVideoProcessor): ``int(duration * video_fps)`` frames
  clamped to [4, video_max_frames] and to the frames available, at ``linspace(0, frames - 1, n).round()``;
  sized by ``smart_resize_video`` with ``video_min_pixels`` / ``video_max_pixels`` bounding the whole
  clip (frames x height x width); an odd count is padded by repeating the last frame.

Their names (``qwen2_vl``, ``qwen3_vl``) are what packed folders and embedding stores record.

Torch-free (numpy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loongforge.models.media import VideoProcessing
from loongforge.models.qwen_vl.processor import MIN_VIDEO_FRAMES
from loongforge.models.qwen_vl.smart_resize import patchify, smart_resize


def sample_frame_indices(
    num_frames: int, native_fps: float, target_fps: float, max_frames: int, temporal_patch_size: int = 2
) -> list[int]:
    """Uniform frame indices: ``duration * target_fps`` frames, clamped to [4, max_frames] and to
    the frames available, rounded down to a multiple of temporal_patch_size (at least one patch)."""
    wanted = num_frames / native_fps * target_fps
    limit = min(max_frames, num_frames) // temporal_patch_size * temporal_patch_size
    count = min(max(wanted, MIN_VIDEO_FRAMES), limit) // temporal_patch_size * temporal_patch_size
    count = max(int(count), temporal_patch_size)
    return [i * num_frames // count for i in range(count)]


def sample_frame_indices_linspace(num_frames: int, native_fps: float, target_fps: float, max_frames: int) -> list[int]:
    """Qwen3-VL's sampling: ``int(duration * target_fps)`` frames clamped to [4, max_frames] and
    to ``num_frames``, spread evenly from the first frame to the last (rounded to the nearest)."""
    count = int(num_frames / native_fps * target_fps)
    count = min(max(count, MIN_VIDEO_FRAMES), max_frames, num_frames)
    return np.linspace(0, num_frames - 1, count).round().astype(int).tolist()


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) for every frame of a clip, multiples of ``factor``, such that the clip's
    volume (frames rounded to ``temporal_factor``, x height x width) lies in [min_pixels,
    max_pixels], keeping the aspect ratio as closely as possible (Qwen3-VL's video rule)."""
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} sampled frame(s) < temporal patch {temporal_factor}")
    if height < factor or width < factor:  # too small: scale up so that the short side is factor
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds 200")
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    volume_t = round(num_frames / temporal_factor) * temporal_factor
    if volume_t * resized_h * resized_w > max_pixels:
        scale = math.sqrt(num_frames * height * width / max_pixels)
        resized_h = max(factor, math.floor(height / scale / factor) * factor)
        resized_w = max(factor, math.floor(width / scale / factor) * factor)
    elif volume_t * resized_h * resized_w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        resized_h = math.ceil(height * scale / factor) * factor
        resized_w = math.ceil(width * scale / factor) * factor
    return resized_h, resized_w


class _QwenVideo(VideoProcessing):
    """What the Qwen-VL video processors share: frames patchified like the images."""

    def patch_rows(self, frames: np.ndarray, temporal_patch_size: int, patch_size: int,
                   merge_size: int) -> np.ndarray:
        return patchify(frames, temporal_patch_size, patch_size, merge_size)


@dataclass(frozen=True)
class Qwen2VLVideo(_QwenVideo):
    """Qwen2-VL's video processor (Qwen2.5-VL's too): uniform frames, each sized on its own."""

    name: str = "qwen2_vl"

    def frame_indices(self, num_frames: int, native_fps: float, target_fps: float, max_frames: int,
                      temporal_patch_size: int) -> list[int]:
        return sample_frame_indices(num_frames, native_fps, target_fps, max_frames, temporal_patch_size)

    def frame_size(self, num_sampled: int, height: int, width: int, temporal_patch_size: int, factor: int,
                   min_pixels: int, max_pixels: int) -> tuple[int, int]:
        return smart_resize(height, width, factor, min_pixels, max_pixels)

    def geometry(self) -> dict:
        return {}  # the only rule before the rule was recorded: folders packed then stay readable


@dataclass(frozen=True)
class Qwen3VLVideo(_QwenVideo):
    """Qwen3-VL's video processor: frames spread from first to last, the clip sized as a whole."""

    name: str = "qwen3_vl"

    def frame_indices(self, num_frames: int, native_fps: float, target_fps: float, max_frames: int,
                      temporal_patch_size: int) -> list[int]:
        return sample_frame_indices_linspace(num_frames, native_fps, target_fps, max_frames)

    def frame_size(self, num_sampled: int, height: int, width: int, temporal_patch_size: int, factor: int,
                   min_pixels: int, max_pixels: int) -> tuple[int, int]:
        return smart_resize_video(num_sampled, height, width, temporal_patch_size, factor, min_pixels, max_pixels)


QWEN2_VL_VIDEO = Qwen2VLVideo()
QWEN3_VL_VIDEO = Qwen3VLVideo()
