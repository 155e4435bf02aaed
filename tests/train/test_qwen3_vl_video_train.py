"""Qwen3-VL trains on real videos: 2 steps of ``loongforge train --preset qwen3vl-tiny`` on the
LoongForge demo mix (text-only, image and MP4 video conversations) with the timestamped
per-frame token layout; every sample is accepted, a video is trained, the losses are finite."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from loongforge.data.conversations import read_json_array
from loongforge.parallel.launch_env import free_port
from tests.shared_data import SHARED_DATA
from tests.train.conftest import RUN_TIMEOUT_S, losses, train_command, train_env

MIX = SHARED_DATA / "loongforge" / "vlm" / "mix.json"
# Small videos (4 frames in a 12544-pixel clip budget: 2 temporal patches of 2 tokens each).
VIDEO_RUN = (
    "data.source=files", f"data.paths=[{MIX}]", "data.read=global",
    "data.video_max_frames=4", "data.video_min_pixels=3136", "data.video_max_pixels=12544",
    "training.train_steps=2", "checkpoint.save_at_end=false",
)


def test_videos_train_with_timestamped_frames(tmp_path):
    command = train_command(tmp_path, *VIDEO_RUN, preset="qwen3vl-tiny")
    port = free_port()
    env = train_env(1, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    proc = subprocess.run([sys.executable, "-m", "tests.train.plan_recorder", str(tmp_path / "plans.jsonl"),
                           *command[3:]], check=False, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-6000:]

    assert json.loads((tmp_path / "summary.json").read_text())["rejects"] == {}
    step_losses = losses(tmp_path)
    assert len(step_losses) == 2 and all(math.isfinite(loss) for loss in step_losses), step_losses
    videos = {f"{MIX}[{r.ordinal}]" for r in read_json_array(MIX.read_text()) if r.record.get("videos")}
    trained = {sid for line in (tmp_path / "plans.jsonl").read_text().splitlines()
               for mb in json.loads(line)["sample_ids"] for sid in mb}
    assert trained & videos, "no video sample in the 2 steps"
