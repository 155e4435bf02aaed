"""``loongforge bench encode``'s figures from runs' records (the runs themselves are real CLI calls)."""

from __future__ import annotations

import pytest

from loongforge.bench.encode import (
    EncodeBenchResult,
    EncodeBenchSettings,
    EncodeMeasure,
    format_report,
    measure_train,
    summary_lines,
)


def _record(step: int, loss: float, step_cpu: list, encoder: list, memory: list) -> dict:
    return {"step": step, "loss": loss, "step_s": 2.0 * step, "step_cpu_s_by_rank": step_cpu,
            "encoder_cpu_s_by_rank": encoder, "peak_memory_mib_by_rank": memory}


def test_training_figures_leave_out_the_warm_up_and_take_the_slowest_rank():
    records = [_record(1, 9.0, [50.0, 1.0], [40.0, 1.0], [100.0, 90.0]),
               _record(2, 8.0, [3.0, 4.0], [2.0, 2.5], [110.0, 120.0]),
               _record(3, 7.0, [5.0, 2.0], [1.0, 0.5], [115.0, 100.0])]
    measure = measure_train("online", records, warmup_steps=1)
    assert (measure.steps, measure.step_s) == (2, 5.0)
    assert measure.step_cpu_s == pytest.approx(4.5)  # mean over steps of max(ranks)
    assert measure.encoder_cpu_s == pytest.approx(1.75)
    assert measure.peak_memory_mib == 120.0 and measure.losses == [9.0, 8.0, 7.0]
    stored = measure_train("stored", [dict(r, encoder_cpu_s_by_rank=[None, None]) for r in records], 1)
    assert stored.encoder_cpu_s is None
    with pytest.raises(ValueError, match="raise --steps"):
        measure_train("short", records[:1], warmup_steps=1)


def test_report_ratios_are_against_one_process_fp32_and_the_online_frozen_run():
    encodes = [EncodeMeasure("fp32, 1 process", 1, "fp32", media=64, tokens=6400, bytes=6400 * 512 + 800, seconds=8.0),
               EncodeMeasure("fp32, 2 processes", 2, "fp32", media=64, tokens=6400, bytes=6400 * 512, seconds=5.0),
               EncodeMeasure("bf16, 1 process", 1, "bf16", media=64, tokens=6400, bytes=6400 * 256, seconds=9.0)]
    online = measure_train("online", [_record(2, 8.0, [4.0, 4.0], [3.0, 3.0], [200.0, 200.0])], 1)
    stored = measure_train("stored", [_record(2, 8.0, [1.0, 1.0], [None, None], [100.0, 50.0])], 1)
    result = EncodeBenchResult(EncodeBenchSettings(), encodes, [online, stored])
    report = format_report(result)
    assert "| fp32, 2 processes | 64 | 12.80 | 1.60x | 512 |" in report
    assert "| bf16, 1 process | 64 | 7.11 | 0.89x | 256 |" in report
    assert "| stored | 4.00 | 1.00 | 0.25x | - | 100 | 0.50x |" in report
    assert summary_lines(result)[1].startswith("training from stored embeddings: step CPU 0.25x, peak memory 0.50x")
