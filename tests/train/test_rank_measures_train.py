"""Per-rank measures in ``metrics.jsonl`` from real training at TP 2 with ``encoder_dp=tp``: one
image per micro-batch, so one rank encodes it (encoder time > 0) and the other encodes nothing
(exactly 0), while both report their step CPU time and peak memory."""

from __future__ import annotations

import json
from pathlib import Path


from tests.shared_data import SHARED_DATA
from tests.train.conftest import run_train, step_metric

PHOTO = SHARED_DATA / "llamafactory" / "mllm_demo_data" / "1.jpg"
# ~260 tokens of answer (the small vocabulary's): with the image's 16 tokens one chat fills most of a
# 384-token row, so each micro-batch holds exactly one chat, one image.
ANSWER = " ".join(["The photo shows two players celebrating on a football pitch."] * 13)


def _one_image_chats(path: Path, count: int) -> Path:
    chats = [{"messages": [{"role": "user", "content": "<image>What is happening?"},
                           {"role": "assistant", "content": ANSWER}], "images": [str(PHOTO)]}] * count
    path.write_text(json.dumps(chats))
    return path


def test_encoder_time_is_reported_per_rank_and_zero_where_nothing_was_encoded(tmp_path):
    data = _one_image_chats(tmp_path / "chats.json", 16)
    out = tmp_path / "run"
    run_train(out, "data.source=files", f"data.paths=[{data}]", "training.train_steps=2",
              "parallel.tensor_model_parallel_size=2", "parallel.vision_tensor_model_parallel_size=1",
              "parallel.encoder_dp=tp", nproc=2)
    for encoder_cpu, encoder_wall in zip(step_metric(out, "encoder_cpu_s_by_rank"),
                                         step_metric(out, "encoder_s_by_rank")):
        # media_assign: a single image goes to the lower rank.
        assert encoder_cpu[0] > 0 and encoder_wall[0] > 0
        assert encoder_cpu[1] == 0.0 and encoder_wall[1] == 0.0
    for step_cpu, memory in zip(step_metric(out, "step_cpu_s_by_rank"), step_metric(out, "peak_memory_mib_by_rank")):
        assert len(step_cpu) == len(memory) == 2
        assert min(step_cpu) > 0 and min(memory) > 100
