"""Media on the data side: reading images (header probe, RGB decode) and videos (probe, frame plan, decode).

Images become patch rows by the run's tower (``VisionSizing.images``, a ``models.media.ImageProcessing``:
Qwen's smart resize, InternVL's tiles, LLaVA-OneVision's anyres); this module reads them. Videos follow
the family's processor (``VisionSizing.video_rule``, a ``models.media.VideoProcessing`` the family's
``ChatFormat.video_rule`` gives): it picks the frames and their size and lays out the patch rows;
this module decodes the frames, resizes each with the same PIL bicubic as images and normalises them
the same way; ``second_per_grid_t = temporal_patch / sampled_fps``.

(transformers' video processors resize with torchvision instead of PIL, so video pixels are
close to, not bit equal to, their output: at most 3 uint8 levels after resizing, 0.0235 after
Qwen3-VL's normalisation, on a demo clip; grids and frame indices follow the same rules.)
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
from PIL import Image

from loongforge.models.media import ImageProcessing, VideoProcessing
from loongforge.models.vlm.pixels import normalize, resize_bicubic

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
    # Per-channel normalisation of video frames (the processor's image_mean / image_std).
    pixel_mean: tuple[float, float, float]
    pixel_std: tuple[float, float, float]
    # The tower's image processor (``models.media``).
    images: ImageProcessing
    # The family's video processor (``ChatFormat.video_rule``); None: the model takes no videos.
    video_rule: Optional[VideoProcessing] = None

    def geometry(self) -> dict:
        """The settings that decide grids and token counts (what a packed folder must agree on): the
        video path's patch geometry and pixel budget, the video rule's (``VideoProcessing.geometry``:
        Qwen2-VL's, the only rule before one was recorded, gives none, so folders packed then read as
        before) and the tower's image processing's (``ImageProcessing.geometry``; Qwen's gives its
        pixel budget, min_pixels and max_pixels)."""
        video = self.video_rule.geometry() if self.video_rule is not None else {}
        return {**self._video_settings(skipped=("video_rule", "pixel_mean", "pixel_std")), **video,
                **self.images.geometry()}

    def settings(self) -> dict:
        """Everything that decides the pixels the encoder sees (what an embedding store must agree on):
        ``geometry`` with the normalisation and the video rule's name (None: no videos)."""
        return {**self._video_settings(skipped=()), **self.images.geometry()}

    def _video_settings(self, skipped: tuple[str, ...]) -> dict:
        settings = {name: getattr(self, name) for name in _SETTINGS_ORDER if name not in skipped}
        if "video_rule" in settings:
            settings["video_rule"] = self.video_rule.name if self.video_rule is not None else None
        return settings

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


# ``settings``' keys in the order it has always written them (encoder.json's ``processor``); the tower's
# image processing says its own (``ImageProcessing.geometry``).
_SETTINGS_ORDER = ("patch_size", "temporal_patch_size", "merge_size", "video_min_pixels", "video_max_pixels",
                   "video_rule", "pixel_mean", "pixel_std")


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


def plan_video(probe: VideoProbe, sizing: VisionSizing, target_fps: float, max_frames: int) -> VideoPlan:
    """The frames to decode and the size to give them, by the family's rule (``sizing.video_rule``);
    ValueError for a model that takes no videos or a clip its rule cannot take."""
    rule = sizing.video_rule
    if rule is None:
        raise ValueError("the model's processor takes no videos; give the frames as images")
    indices = rule.frame_indices(probe.num_frames, probe.fps, target_fps, max_frames, sizing.temporal_patch_size)
    resized_h, resized_w = rule.frame_size(len(indices), probe.height, probe.width, sizing.temporal_patch_size,
                                           sizing.factor, sizing.video_min_pixels, sizing.video_max_pixels)
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
    return sizing.video_rule.patch_rows(stacked, sizing.temporal_patch_size, sizing.patch_size, sizing.merge_size)
