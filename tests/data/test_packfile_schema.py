"""Pack shard rows keep each video's frame rate, and rows written before it was kept still read."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from loongforge.data.measure import MeasuredSample
from loongforge.data.packfile.schema import SCHEMA, VIDEO_PLAN, decode_pack, encode_pack
from loongforge.data.vision import VideoPlan, VisionSizing, frame_timestamps
from loongforge.models.qwen_vl.smart_resize import SmartResizeImages
from loongforge.models.qwen_vl.video import QWEN2_VL_VIDEO, QWEN3_VL_VIDEO

PLAN = VideoPlan(frame_indices=(0, 81, 161, 242), resized_height=64, resized_width=96, grid_thw=(2, 4, 6),
                 second_per_grid_t=4.86, fps=25.0)


def _sample() -> MeasuredSample:
    return MeasuredSample(sample_id="data.json:3", file="data.json", line=3, input_ids=np.arange(5),
                          is_answer=np.zeros(5, dtype=bool), videos=["/clips/a.mp4"], video_plans=[PLAN])


def test_video_plan_round_trips_with_its_frame_rate():
    table = pa.Table.from_pylist([encode_pack(0, [_sample()])], schema=SCHEMA)
    (sample,) = decode_pack(table.to_pylist()[0])
    assert sample.video_plans == [PLAN]


def test_rows_packed_before_the_frame_rate_read_without_it():
    old_plan = pa.struct([field for field in VIDEO_PLAN if field.name != "fps"])
    old_schema = pa.schema([pa.field(f.name, pa.list_(pa.list_(old_plan))) if f.name == "video_plans" else f
                            for f in SCHEMA])
    row = encode_pack(0, [_sample()])
    row["video_plans"] = [[{k: v for k, v in plan.items() if k != "fps"} for plan in plans]
                          for plans in row["video_plans"]]
    (sample,) = decode_pack(pa.Table.from_pylist([row], schema=old_schema).to_pylist()[0])
    assert sample.video_plans[0].fps is None
    assert sample.video_plans[0].grid_thw == PLAN.grid_thw
    with pytest.raises(ValueError, match="no frame rate"):  # timestamps need it: repack
        frame_timestamps(sample.video_plans[0], 2)


def test_timestamps_average_each_temporal_patch():
    # frames 0 and 81 -> (0 + 3.24) / 2; frames 161 and 242 -> (6.44 + 9.68) / 2
    assert frame_timestamps(PLAN, 2) == pytest.approx([1.62, 8.06])
    odd = VideoPlan(frame_indices=(0, 50, 100), resized_height=64, resized_width=64, grid_thw=(2, 4, 4),
                    second_per_grid_t=1.0, fps=25.0)
    assert frame_timestamps(odd, 2) == pytest.approx([1.0, 4.0])  # the last frame repeats


def test_geometry_names_the_video_rule_only_when_not_qwen2_vl():
    """Folders packed before the rule was recorded (all Qwen2-VL's) stay readable; a Qwen3-VL run
    asks for its rule, so a folder packed with the other one is refused with a repack message."""
    images = SmartResizeImages(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=1, max_pixels=2)
    sizing = VisionSizing(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=1, max_pixels=2,
                          video_min_pixels=1, video_max_pixels=2, pixel_mean=images.mean, pixel_std=images.std,
                          images=images, video_rule=QWEN2_VL_VIDEO)
    assert "video_rule" not in sizing.geometry() and sizing.settings()["video_rule"] == "qwen2_vl"
    assert replace(sizing, video_rule=None).geometry() == sizing.geometry()  # a model without videos
    qwen3 = replace(sizing, video_rule=QWEN3_VL_VIDEO)
    assert qwen3.geometry()["video_rule"] == qwen3.settings()["video_rule"] == "qwen3_vl"
