"""Qwen3-VL video samples equal transformers' processor: frame indices, grid, timestamped token
layout (``<t seconds>`` + one vision block per temporal patch) and M-RoPE positions.

The reference is transformers' own code: ``Qwen3VLVideoProcessor.sample_frames`` on the metadata
``read_video_pyav`` reads, its ``patchify`` for the grid, ``Qwen3VLProcessor.replace_video_token``
and ``get_text_with_replacements`` for the text, the offline Qwen tokenizer for the ids and
``Qwen3VLModel.get_rope_index`` for positions. This environment has no torchvision, which the
processor's resize needs, so the reference frames are resized with the kernel torchvision's
``resize`` calls for uint8 bicubic (``torch.nn.functional.interpolate``, antialiased, clamped and
rounded back to uint8); see ``test_video_pixels_close_to_transformers`` for the measured gap.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.data.measure import SampleMeasurer, materialize, vision_sizing
from loongforge.data.samples import ConversationSample
from loongforge.data.template import Turn
from loongforge.data.tokenizer import load_tokenizer
from loongforge.data.vision import frame_timestamps
from loongforge.models.registry import get_family
from tests.data.conftest import LLAMAFACTORY, require

VIDEO = LLAMAFACTORY / "mllm_demo_data" / "1.mp4"  # a real demo clip: 243 frames at 25 fps, 640x360
MAX_FRAMES = 8  # 4 temporal patches: the layout of every patch is checked, quickly
# Measured on this clip (PIL bicubic vs torch's antialiased bicubic, 640x360 -> 352x192): 3 uint8
# levels at most after resizing, i.e. 3/255/0.5 = 0.0235 after normalising with mean = std = 0.5
# (mean abs diff 1.1e-3; most pixels equal up to float rounding, 3e-8).
PIXEL_TOLERANCE = 3 / 255 / 0.5 + 1e-6


@pytest.fixture(scope="module")
def run():
    require(VIDEO)
    cfg = load_run_config("qwen3vl-tiny", overrides=[f"data.video_max_frames={MAX_FRAMES}"])
    tokenizer = load_tokenizer("qwen", get_family("qwen3_vl").chat(cfg.model).jinja_template)
    return cfg, tokenizer


def _turns():
    return [Turn("user", "<video>Why is this video funny?"), Turn("assistant", "Because a baby wears glasses.")]


def _ours(cfg, tokenizer):
    sample = ConversationSample(sample_id=f"{VIDEO}:1", file=str(VIDEO), line=1, turns=_turns(), videos=[str(VIDEO)])
    measured = SampleMeasurer(tokenizer, cfg.data, cfg.model).measure(sample)
    assert not hasattr(measured, "reason"), measured
    return measured


def _video_processor(cfg):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    vision = cfg.model.vision
    return Qwen3VLVideoProcessor(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=cfg.model.projector.spatial_merge_size, fps=cfg.data.video_fps, min_frames=4,
        max_frames=cfg.data.video_max_frames, image_mean=list(vision.pixel_mean), image_std=list(vision.pixel_std),
        size={"shortest_edge": cfg.data.video_min_pixels, "longest_edge": cfg.data.video_max_pixels},
        cap_pixels_per_frame=False,
    )


def _reference_video(cfg):
    """transformers' frames, metadata, pixel_values_videos and grid for VIDEO."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import read_video_pyav

    processor = _video_processor(cfg)
    frames, metadata = read_video_pyav(str(VIDEO), sample_indices_fn=processor.sample_frames)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]  # [1, T, 3, H, W] uint8
    height, width = smart_resize(video.shape[1], *video.shape[-2:], temporal_factor=processor.temporal_patch_size,
                                 factor=processor.patch_size * processor.merge_size,
                                 min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"])
    resized = torch.nn.functional.interpolate(video[0].float(), size=(height, width), mode="bicubic",
                                              antialias=True).clamp_(0, 255).round_().to(torch.uint8)[None]
    mean = torch.tensor(processor.image_mean).view(1, 1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 1, 3, 1, 1)
    normalized = (resized.float() - mean * 255) / (std * 255)  # the processor's fused rescale + normalise
    pixels, grid_t, grid_h, grid_w = processor.patchify(normalized, processor.patch_size, processor.merge_size,
                                                        processor.temporal_patch_size)
    return processor, metadata, pixels[0], torch.tensor([[grid_t, grid_h, grid_w]])


def _reference_ids(cfg, tokenizer, processor, metadata, grid):
    from transformers import Qwen3VLProcessor

    # Without torchvision, ProcessorMixin.__init__ rejects the video processor class (its auto
    # mapping is a placeholder); the text methods need only these attributes.
    hf = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    hf.video_processor, hf.tokenizer = processor, tokenizer
    hf.image_token, hf.video_token = "<|image_pad|>", "<|video_pad|>"
    hf.vision_start_token, hf.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Why is this video funny?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Because a baby wears glasses."}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    replacement = hf.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, video_idx=0)
    (expanded,), _ = hf.get_text_with_replacements([text], videos_replacements=[replacement])
    return torch.tensor(tokenizer(expanded, add_special_tokens=False)["input_ids"]), expanded


def test_video_sample_equals_transformers(run):
    from transformers import Qwen3VLProcessor

    from tests.models.test_qwen3_vl_support import build_hf_model, tiny_model_cfg

    cfg, tokenizer = run
    measured = _ours(cfg, tokenizer)
    processor, metadata, _, grid = _reference_video(cfg)
    plan = measured.video_plans[0]
    assert list(plan.frame_indices) == list(metadata.frames_indices)
    assert plan.fps == metadata.fps
    assert torch.equal(torch.tensor([plan.grid_thw]), grid)
    hf_times = Qwen3VLProcessor._calculate_timestamps(None, list(metadata.frames_indices), metadata.fps,
                                                      cfg.model.vision.temporal_patch_size)
    assert frame_timestamps(plan, cfg.model.vision.temporal_patch_size) == hf_times

    hf_ids, text = _reference_ids(cfg, tokenizer, processor, metadata, grid)
    assert text.count("seconds>") == grid[0, 0] and "<0.7 seconds><|vision_start|>" in text
    assert torch.equal(torch.from_numpy(measured.input_ids), hf_ids)
    # Timestamps and vision markers are inputs only: the answer is the assistant text alone.
    answer = tokenizer.decode(measured.input_ids[measured.is_answer])
    assert answer == "Because a baby wears glasses.<|im_end|>"

    ours = get_family("qwen3_vl").position_ids(cfg.model)(hf_ids, None, grid, [plan.second_per_grid_t])
    hf_model = build_hf_model(tiny_model_cfg())
    token_type = (hf_ids == cfg.model.tokens.video_token_id).long() * 2
    hf_positions, _ = hf_model.model.get_rope_index(hf_ids[None], token_type[None], video_grid_thw=grid)
    assert torch.equal(ours, hf_positions[:, 0])


def test_video_pixels_close_to_transformers(run):
    """Same frames, size and patch layout as transformers; pixels differ by the resize kernel:
    PIL's bicubic here, torch's antialiased bicubic (torchvision's) there. Measured on this clip:
    max abs diff 0.0235 (3 uint8 levels) after normalising, mean 1.1e-3; we assert that bound."""
    cfg, tokenizer = run
    measured = _ours(cfg, tokenizer)
    ours = materialize(measured, vision_sizing(cfg.data, cfg.model)).video_pixels[0]
    _, _, reference, _ = _reference_video(cfg)
    assert ours.shape == tuple(reference.shape)
    diff = np.abs(ours - reference.numpy())
    print(f"video pixels: max abs diff {diff.max():.6f}, mean {diff.mean():.2e}")
    assert diff.max() <= PIXEL_TOLERANCE


def test_qwen3_video_rule_sizes_the_clip_not_each_frame(run):
    """video_min/max_pixels bound frames x height x width for Qwen3-VL (its processor's rule)."""
    cfg, tokenizer = run
    plan = _ours(cfg, tokenizer).video_plans[0]
    frames = len(plan.frame_indices)
    assert frames == MAX_FRAMES and math.ceil(frames / 2) == plan.grid_thw[0]
    assert frames * plan.resized_height * plan.resized_width <= cfg.data.video_max_pixels
