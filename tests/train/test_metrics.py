"""The run logger's per-rank measures: one list per measure in metrics.jsonl, None kept for a rank
without the encoder, the slowest encoder rank in the log line and in TensorBoard."""

from __future__ import annotations

import json

from loongforge.train.metrics import METRICS_FILE, RunLogger, StepMetrics, format_log_line

BY_RANK = {"encoder_s": [2.5, 1.5, None, None], "encoder_cpu_s": [2.0, 1.0, None, None],
           "step_cpu_s": [3.0, 3.0, 0.5, 0.5], "peak_memory_mib": [900.0, 910.0, 400.0, 400.0]}


def _metrics(by_rank: dict) -> StepMetrics:
    return StepMetrics(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=100, step_s=4.0, data_wait_s=0.1,
                       by_rank=by_rank)


def test_per_rank_measures_are_logged_as_lists(tmp_path):
    logger = RunLogger(tmp_path, total_steps=1, start_step=0, log_interval=1, enabled=True,
                       tensorboard=True, progress_bar=False)
    logger.log_step(_metrics(BY_RANK))
    logger.close()
    record = json.loads((tmp_path / METRICS_FILE).read_text())
    assert record["encoder_cpu_s_by_rank"] == [2.0, 1.0, None, None]
    assert record["peak_memory_mib_by_rank"] == [900.0, 910.0, 400.0, 400.0]
    assert any((tmp_path / "tensorboard").iterdir())


def test_log_line_names_the_slowest_encoder_rank_only_when_there_is_one():
    assert "| encoder max 2.50s" in format_log_line(_metrics(BY_RANK), 1)
    assert "encoder" not in format_log_line(_metrics({"encoder_s": [None, None]}), 1)
    assert "encoder" not in format_log_line(_metrics({}), 1)
