"""Qwen3-VL trains on real videos: 2 steps of ``loongforge train --preset qwen3vl-tiny`` on the
LoongForge demo mix (text-only, image and MP4 video conversations) with the timestamped
per-frame token layout; every sample is accepted, a video is trained, the losses are finite."""

from __future__ import annotations

import json
import math

from loongforge.data.conversations import read_json_array
from tests.shared_data import SHARED_DATA
from tests.train.conftest import SMALL_VIDEOS, losses, run_recorded

MIX = SHARED_DATA / "loongforge" / "vlm" / "mix.json"
# Small videos (4 frames in a 12544-pixel clip budget: 2 temporal patches of 2 tokens each).
VIDEO_RUN = (
    "data.source=files", f"data.paths=[{MIX}]", "data.read=global",
    *SMALL_VIDEOS,
    "training.train_steps=2", "checkpoint.save_at_end=false",
)


def test_videos_train_with_timestamped_frames(tmp_path):
    run_recorded(tmp_path, *VIDEO_RUN, nproc=1, preset="qwen3vl-tiny")

    assert json.loads((tmp_path / "summary.json").read_text())["rejects"] == {}
    step_losses = losses(tmp_path)
    assert len(step_losses) == 2 and all(math.isfinite(loss) for loss in step_losses), step_losses
    videos = {f"{MIX}[{r.ordinal}]" for r in read_json_array(MIX.read_text()) if r.record.get("videos")}
    trained = {sid for line in (tmp_path / "plans_rank0.jsonl").read_text().splitlines()
               for mb in json.loads(line)["sample_ids"] for sid in mb}
    assert trained & videos, "no video sample in the 2 steps"
