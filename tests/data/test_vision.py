"""Image preprocessing equals transformers' Qwen2-VL image processor; probes and video plans."""

import io
import random

import numpy as np
import pytest
from PIL import Image

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.measure import vision_sizing
from loongforge.data.vision import (
    MediaError,
    decode_video_frames,
    load_rgb_image,
    plan_video,
    preprocess_video,
    probe_image_size,
    probe_video,
)
from loongforge.models.qwen_vl.smart_resize import patchify, smart_resize
from loongforge.models.qwen_vl.video import sample_frame_indices
from tests.data.conftest import COCO_IMAGES, LLAMAFACTORY, require

SIZING = vision_sizing(DataConfig(), ModelConfig(family="qwen2_5_vl"))  # the schema's 7B dims: Qwen2-VL's processor


def preprocess_image(image, sizing):
    """(patch rows, grid) by the run's tower (Qwen2-VL's smart resize here)."""
    return sizing.images.pixels(image)


@pytest.fixture(scope="module")
def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil()  # default args: CLIP mean/std, 56*56..28*28*1280 pixels, bicubic


def _real_images() -> list:
    coco = sorted(require(COCO_IMAGES).glob("*.jpg"))[:8]
    demo = sorted(require(LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))
    return coco + demo


def test_pixel_values_equal_transformers(hf_image_processor):
    for path in _real_images():
        expected = hf_image_processor(images=[Image.open(path)], return_tensors="np")
        pixels, grid = preprocess_image(load_rgb_image(path), SIZING)
        assert [list(grid)] == expected["image_grid_thw"].tolist(), path
        assert pixels.shape == expected["pixel_values"].shape and pixels.dtype == np.float32
        assert np.abs(pixels - expected["pixel_values"]).max() == 0.0, path


def test_rgba_palette_and_grey_images_equal_transformers(hf_image_processor):
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (61, 97, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (300, 41), dtype=np.uint8), "L")
    palette = rgba.convert("RGB").convert("P")
    big = Image.fromarray(rng.integers(0, 256, (1500, 1400, 3), dtype=np.uint8))  # hits max_pixels
    for image in (rgba, grey, palette, big):
        expected = hf_image_processor(images=[image], return_tensors="np")
        pixels, grid = preprocess_image(load_rgb_image(image), SIZING)
        assert [list(grid)] == expected["image_grid_thw"].tolist()
        assert np.abs(pixels - expected["pixel_values"]).max() == 0.0


def test_qwen3_vl_images_equal_transformers_image_processor_as_qwen3_vl_configures_it():
    """Qwen3-VL's preprocessor_config: the Qwen2-VL image processor with 16-pixel patches and mean =
    std = 0.5. Its PIL backend is the reference here (the torchvision one needs torchvision, which has
    no build for this machine's torch); sizes at the qwen3vl-8b preset's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from loongforge.config.loader import load_run_config

    cfg = load_run_config("qwen3vl-8b")
    sizing = vision_sizing(cfg.data, cfg.model)
    assert (sizing.patch_size, sizing.pixel_mean, sizing.pixel_std) == (16, (0.5,) * 3, (0.5,) * 3)
    reference = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                         min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    rng = np.random.default_rng(0)
    odd = [Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)),  # below min_pixels
           Image.fromarray(rng.integers(0, 256, (1500, 1400, 3), dtype=np.uint8))]  # above max_pixels
    for image in [Image.open(path) for path in _real_images()] + odd:
        expected = reference(images=[image], return_tensors="np")
        pixels, grid = preprocess_image(load_rgb_image(image), sizing)
        assert [list(grid)] == expected["image_grid_thw"].tolist()
        assert np.abs(pixels - expected["pixel_values"]).max() == 0.0


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = random.Random(0)
    for _ in range(2000):
        height, width = rng.randint(10, 6000), rng.randint(10, 6000)
        if max(height, width) / min(height, width) > 200:
            continue
        assert smart_resize(height, width, 28, 3136, 1003520) == hf_smart_resize(height, width, 28, 3136, 1003520)


def test_probe_reads_header_only_and_matches_decoded_grid():
    for path in _real_images():
        width, height = probe_image_size(path)
        assert (width, height) == Image.open(path).size
        decoded = preprocess_image(load_rgb_image(path), SIZING)[1]
        assert SIZING.images.plan(width, height).grid == decoded


def test_probe_catches_missing_truncated_and_garbage(tmp_path):
    source = sorted(require(COCO_IMAGES).glob("*.jpg"))[0].read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(source[: len(source) // 2])
    (tmp_path / "garbage.jpg").write_bytes(b"this is not an image at all")
    with pytest.raises(MediaError) as missing:
        probe_image_size(tmp_path / "absent.jpg")
    assert missing.value.reason == "missing_image"
    for name in ("truncated.jpg", "garbage.jpg"):
        with pytest.raises(MediaError) as corrupt:
            probe_image_size(tmp_path / name)
        assert corrupt.value.reason == "corrupt_image"
    png = io.BytesIO()
    Image.new("RGB", (30, 20)).save(png, format="PNG")
    assert probe_image_size(png.getvalue()) == (30, 20)


def test_frame_sampling_rules():
    assert sample_frame_indices(243, 25.0, 2.0, 32) == [i * 243 // 18 for i in range(18)]  # 9.72 s -> 18 frames
    assert len(sample_frame_indices(3000, 30.0, 2.0, 32)) == 32  # capped by max_frames
    assert len(sample_frame_indices(10, 30.0, 2.0, 32)) == 4  # at least 4 frames when available
    assert len(sample_frame_indices(3, 30.0, 2.0, 32)) == 2  # never below one temporal patch
    assert all(len(sample_frame_indices(n, 24.0, 2.0, 31)) % 2 == 0 for n in range(2, 2000, 37))


@pytest.mark.parametrize("name", ["1.mp4", "2.avi", "4.mp4"])
def test_real_video_plan_and_pixels(name):
    pytest.importorskip("av")
    path = require(LLAMAFACTORY / "mllm_demo_data" / name)
    plan = plan_video(probe_video(path), SIZING, target_fps=2.0, max_frames=32)
    frames = decode_video_frames(path, plan.frame_indices)
    pixels = preprocess_video(frames, plan, SIZING)
    grid_t, grid_h, grid_w = plan.grid_thw
    assert grid_t * 2 == len(plan.frame_indices) and pixels.shape == (grid_t * grid_h * grid_w, 1176)
    assert (grid_h * 14) * (grid_w * 14) <= SIZING.video_max_pixels
    assert np.isfinite(pixels).all() and pixels.std() > 0.1
    # seconds per temporal patch: 2 frames at the sampled rate (close to 2 fps here)
    assert plan.second_per_grid_t == pytest.approx(1.0, rel=0.1)


def test_video_patch_order_matches_image_order():
    # A two-frame video of one image must patchify exactly like the image (temporal slots equal).
    image = load_rgb_image(sorted(require(LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))[0])
    image_pixels, (_, grid_h, grid_w) = preprocess_image(image, SIZING)
    from loongforge.data.vision import VideoPlan

    plan = VideoPlan((0, 1), grid_h * 14, grid_w * 14, (1, grid_h, grid_w), 1.0)
    assert np.array_equal(preprocess_video([image, image], plan, SIZING), image_pixels)


def _transformers_video_patchify():
    """transformers' Qwen2VLVideoProcessor.patchify, lifted from its source: the module imports
    torchvision at the top, which this CPU venv does not have, but patchify itself is plain torch."""
    import ast
    import importlib.util

    import torch

    spec = importlib.util.find_spec("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[func], type_ignores=[]), spec.origin, "exec"), namespace)
    return namespace["patchify"]


def test_video_patchify_matches_transformers_video_processor():
    import torch

    frames = np.random.default_rng(0).standard_normal((4, 56, 84, 3)).astype(np.float32)  # [T, H, W, C]
    videos = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].contiguous()  # [1, T, C, H, W]
    expected, grid_t, grid_h, grid_w = _transformers_video_patchify()(
        None, videos, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (grid_t, grid_h, grid_w) == (2, 4, 6)
    assert np.array_equal(patchify(frames, 2, 14, 2), expected[0].numpy())
