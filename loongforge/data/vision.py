"""Media on the data side: reading images (header probe, RGB decode) and the Qwen-VL video path.

Images become patch rows by the run's tower (``VisionSizing.images``, a ``models.media.ImageProcessing``:
Qwen's smart resize, InternVL's tiles, LLaVA-OneVision's anyres); this module reads them. Videos follow
Qwen2-VL's processing (``models.qwen_vl.smart_resize``: the same resize rule and patch layout as its images).

Video: frames are sampled and sized by the family's rule (``VIDEO_RULES``, named by
``ChatFormat.video_rule``), resized per frame with the same PIL bicubic and normalised the same
way; ``second_per_grid_t = temporal_patch / sampled_fps``.

- ``qwen2_vl`` (Qwen2-VL, Qwen2.5-VL): frames at ``video_fps`` (at most ``video_max_frames``, at
  least 4 when the video has them, an even count); each frame sized by ``smart_resize`` with
  ``video_min_pixels`` / ``video_max_pixels`` per frame.
- ``qwen3_vl`` (transformers' Qwen3VLVideoProcessor): ``int(duration * video_fps)`` frames clamped
  to [4, video_max_frames] and to the frames available, at ``linspace(0, frames - 1, n).round()``;
  sized by ``smart_resize_video`` with ``video_min_pixels`` / ``video_max_pixels`` bounding the
  whole clip (frames x height x width); an odd count is padded by repeating the last frame.

(transformers' video processors resize with torchvision instead of PIL, so video pixels are
close to, not bit equal to, their output: at most 3 uint8 levels after resizing, 0.0235 after
Qwen3-VL's normalisation, on a demo clip; grids and frame indices follow the same rules.)
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Union

import numpy as np
from PIL import Image

from loongforge.models.media import ImageProcessing
from loongforge.models.vlm.pixels import normalize, resize_bicubic
from loongforge.models.qwen_vl.smart_resize import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    SmartResizeImages,
    patchify,
    smart_resize,
)

MIN_VIDEO_FRAMES = 4  # transformers' Qwen2-VL video processor default

# A media item: a path, raw encoded bytes, or an already decoded image (synthetic data).
ImageSource = Union[str, Path, bytes, Image.Image]


class MediaError(Exception):
    """A media file that cannot be used; ``reason`` is a reject reason (missing_image, corrupt_image)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class VisionSizing:
    """How a run's media become patches: the tower's image processing (``images``) and the video
    path's patch geometry and pixel budgets; built by ``data.measure.vision_sizing`` from
    ModelConfig.vision/projector and DataConfig, whose defaults are the only ones."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    # How videos are sampled and sized: a key of VIDEO_RULES (``ChatFormat.video_rule``).
    video_rule: str = "qwen2_vl"
    # Per-channel normalisation (the processor's image_mean / image_std).
    pixel_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    pixel_std: tuple[float, float, float] = OPENAI_CLIP_STD
    # The tower's image processor (``models.media``); None: Qwen2-VL's at the fields above.
    images: Optional[ImageProcessing] = None

    def __post_init__(self):
        if self.images is None:
            object.__setattr__(self, "images", SmartResizeImages(
                self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels, self.max_pixels,
                self.pixel_mean, self.pixel_std))

    def geometry(self) -> dict:
        """The settings that decide grids and token counts (what a packed folder must agree on): the
        video path's and the tower's image processing's (``ImageProcessing.geometry``; Qwen's gives its
        pixel budget, min_pixels and max_pixels, so Qwen folders read as before)."""
        geometry = self._video_settings(skipped=("pixel_mean", "pixel_std"))
        if self.video_rule == "qwen2_vl":  # the only rule before it was recorded: old folders stay readable
            del geometry["video_rule"]
        return {**geometry, **self.images.geometry()}

    def settings(self) -> dict:
        """Everything that decides the pixels the encoder sees (what an embedding store must agree on):
        ``geometry`` with the normalisation and the video rule."""
        return {**self._video_settings(skipped=()), **self.images.geometry()}

    def _video_settings(self, skipped: tuple[str, ...]) -> dict:
        image_fields = ("images", "min_pixels", "max_pixels")  # the tower's image processing says its own
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in image_fields + skipped}

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


# ---------------------------------------------------------------- images: cheap probe


def probe_image_size(source: ImageSource) -> tuple[int, int]:
    """(width, height) from the header only; raises MediaError. Also catches truncated JPEG/PNG
    files cheaply (end marker missing), so they are rejected before packing rather than after."""
    if isinstance(source, Image.Image):
        return source.size
    try:
        with _open_image(source) as image:
            size = image.size
            image_format = image.format
    except FileNotFoundError as error:
        raise MediaError("missing_image", f"{source}: {error.strerror}") from None
    except Exception as error:  # PIL raises many types for unreadable headers
        raise MediaError("corrupt_image", f"{_describe(source)}: {error}") from None
    if min(size) < 1:
        raise MediaError("corrupt_image", f"{_describe(source)}: empty image {size}")
    _check_end_marker(source, image_format)
    return size


def _open_image(source: ImageSource) -> Image.Image:
    if isinstance(source, bytes):
        return Image.open(io.BytesIO(source))
    return Image.open(source)


def _describe(source: ImageSource) -> str:
    return f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)


_END_MARKERS = {"JPEG": b"\xff\xd9", "PNG": b"IEND"}


def _check_end_marker(source: ImageSource, image_format: str | None) -> None:
    marker = _END_MARKERS.get(image_format or "")
    if marker is None:
        return
    # Some encoders pad after the end marker; look at the tail rather than the last bytes.
    if isinstance(source, bytes):
        tail = source[-4096:]
    else:
        with open(source, "rb") as f:
            f.seek(0, io.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read()
    if marker not in tail:
        raise MediaError("corrupt_image", f"{_describe(source)}: truncated {image_format} (no end marker)")


def num_llm_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """LLM placeholder tokens for one image/video: one per merged merge_size x merge_size group."""
    grid_t, grid_h, grid_w = grid_thw
    return grid_t * grid_h * grid_w // (merge_size * merge_size)


# ---------------------------------------------------------------- images: decode + patchify


def load_rgb_image(source: ImageSource) -> Image.Image:
    """Fully decoded RGB image; transparency composited on white as transformers does."""
    try:
        image = source if isinstance(source, Image.Image) else _open_image(source)
        image.load()
        return to_rgb(image)
    except FileNotFoundError as error:
        raise MediaError("missing_image", f"{source}: {error.strerror}") from None
    except Exception as error:
        raise MediaError("corrupt_image", f"{_describe(source)}: {error}") from None


def to_rgb(image: Image.Image) -> Image.Image:
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def normalize_frame(pixels_uint8: np.ndarray, sizing: VisionSizing) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [H, W, 3] with the model's mean and std (``models.vlm.pixels``)."""
    return normalize(pixels_uint8, sizing.pixel_mean, sizing.pixel_std)


# ---------------------------------------------------------------- video


@dataclass(frozen=True)
class VideoProbe:
    """Container metadata read without decoding."""

    num_frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True)
class VideoPlan:
    """What materialisation will produce for one video, known before decoding any frame."""

    frame_indices: tuple[int, ...]
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float  # seconds of video covered by one temporal patch
    # The container's frame rate (frames per second): frame index / fps is a frame's time, which
    # Qwen3-VL writes as text before each temporal patch. None in folders packed before it was kept.
    fps: float | None = None


def _import_av():
    try:
        import av  # lazy: optional, only for video
    except ImportError as error:  # pragma: no cover - exercised only without the optional dep
        raise MediaError("corrupt_image", "video support needs PyAV: pip install av") from error
    return av


def path_exists(path: str | Path) -> bool:
    """``Path.exists`` that answers False for a path the OS cannot even look up (a file name over
    the system's limit raises from ``Path.exists``): data files hold such paths."""
    try:
        return Path(path).exists()
    except OSError:
        return False


def probe_video(path: str | Path) -> VideoProbe:
    """Frame count, frame rate and size from the container; raises MediaError."""
    av = _import_av()
    if not path_exists(path):
        raise MediaError("missing_image", f"{path}: video not found")
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            num_frames = stream.frames or _count_video_packets(container, stream)
            width, height = stream.codec_context.width, stream.codec_context.height
    except Exception as error:
        raise MediaError("corrupt_image", f"{path}: unreadable video: {error}") from None
    if num_frames < 1 or fps <= 0 or min(width, height) < 1:
        raise MediaError("corrupt_image", f"{path}: video has frames={num_frames} fps={fps} size={width}x{height}")
    return VideoProbe(num_frames=num_frames, fps=fps, width=width, height=height)


def _count_video_packets(container, stream) -> int:
    # Some containers do not record a frame count; demuxing counts frames without decoding.
    return sum(1 for packet in container.demux(stream) if packet.size > 0)


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


def plan_video(probe: VideoProbe, sizing: VisionSizing, target_fps: float, max_frames: int) -> VideoPlan:
    """The frames to decode and the size to give them, by the family's rule (``sizing.video_rule``)."""
    if sizing.video_rule not in VIDEO_RULES:
        raise ValueError(f"unknown video rule {sizing.video_rule!r}; known: {sorted(VIDEO_RULES)}")
    return VIDEO_RULES[sizing.video_rule](probe, sizing, target_fps, max_frames)


def _plan_qwen2_vl(probe: VideoProbe, sizing: VisionSizing, target_fps: float, max_frames: int) -> VideoPlan:
    indices = sample_frame_indices(probe.num_frames, probe.fps, target_fps, max_frames, sizing.temporal_patch_size)
    resized_h, resized_w = smart_resize(
        probe.height, probe.width, sizing.factor, sizing.video_min_pixels, sizing.video_max_pixels
    )
    return _video_plan(probe, sizing, indices, resized_h, resized_w)


def _plan_qwen3_vl(probe: VideoProbe, sizing: VisionSizing, target_fps: float, max_frames: int) -> VideoPlan:
    indices = sample_frame_indices_linspace(probe.num_frames, probe.fps, target_fps, max_frames)
    resized_h, resized_w = smart_resize_video(
        len(indices), probe.height, probe.width, sizing.temporal_patch_size, sizing.factor,
        sizing.video_min_pixels, sizing.video_max_pixels,
    )
    return _video_plan(probe, sizing, indices, resized_h, resized_w)


def _video_plan(probe: VideoProbe, sizing: VisionSizing, indices: list[int], resized_h: int,
                resized_w: int) -> VideoPlan:
    sampled_fps = len(indices) / (probe.num_frames / probe.fps)
    grid_t = -(-len(indices) // sizing.temporal_patch_size)  # an odd count is padded with the last frame
    return VideoPlan(
        frame_indices=tuple(indices),
        resized_height=resized_h,
        resized_width=resized_w,
        grid_thw=(grid_t, resized_h // sizing.patch_size, resized_w // sizing.patch_size),
        second_per_grid_t=sizing.temporal_patch_size / sampled_fps,
        fps=probe.fps,
    )


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


VIDEO_RULES = {"qwen2_vl": _plan_qwen2_vl, "qwen3_vl": _plan_qwen3_vl}


def frame_timestamps(plan: VideoPlan, temporal_patch_size: int) -> list[float]:
    """Seconds at each temporal patch: the mean time of its first and last frame (an odd frame
    count repeats the last frame), frame time = index / the video's frame rate."""
    if plan.fps is None:
        raise ValueError("this video plan has no frame rate (packed before it was recorded); repack the data")
    indices = list(plan.frame_indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    seconds = [index / plan.fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def decode_video_frames(path: str | Path, frame_indices: tuple[int, ...]) -> list[Image.Image]:
    """RGB frames at the given decode-order indices. If the stream holds fewer frames than its
    header promised, its last frame stands in for the missing ones, so the planned grid holds."""
    av = _import_av()
    wanted = set(frame_indices)
    decoded: dict[int, Image.Image] = {}
    last_frame = None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for index, frame in enumerate(container.decode(stream)):
                if index in wanted:
                    decoded[index] = frame.to_image()
                last_frame = frame
                if index >= max(frame_indices):
                    break
    except Exception as error:
        raise MediaError("corrupt_image", f"{path}: video decode failed: {error}") from None
    if last_frame is None:
        raise MediaError("corrupt_image", f"{path}: no decodable frames")
    missing = wanted - decoded.keys()
    if missing:
        stand_in = last_frame.to_image()
        decoded.update({index: stand_in for index in missing})
    return [to_rgb(decoded[index]) for index in frame_indices]


def preprocess_video(frames: list[Image.Image], plan: VideoPlan, sizing: VisionSizing) -> np.ndarray:
    """Frames -> pixel_values_videos float32 [grid_t*grid_h*grid_w, 3*2*14*14]."""
    stacked = np.stack(
        [normalize_frame(resize_bicubic(frame, plan.resized_height, plan.resized_width), sizing) for frame in frames]
    )  # [T, H, W, 3]
    pad = -len(frames) % sizing.temporal_patch_size
    if pad:  # repeat the last frame, as transformers does
        stacked = np.concatenate([stacked, np.repeat(stacked[-1:], pad, axis=0)])
    return patchify(stacked, sizing.temporal_patch_size, sizing.patch_size, sizing.merge_size)
