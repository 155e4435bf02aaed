"""bench pipeline: the measured bubble from each rank's schedule wall and CPU seconds, the report, and
one real interleaved run whose ranks log both."""

import json

import pytest
from typer.testing import CliRunner

from loongforge.bench.pipeline import (
    PipelineSettings,
    dry_run_bubble,
    format_doc,
    measure_schedule,
    run_pipeline_bench,
    schedule_config,
)
from loongforge.train.pipeline_plan import equal_stage_bubble
from loongforge.cli.app import app


def _record(step: int, walls: list[float], cpus: list[float]) -> dict:
    return {"step": step, "step_s": sum(walls), "pipeline_s_by_rank": walls, "pipeline_cpu_s_by_rank": cpus}


def test_the_bubble_is_the_ranks_waiting_share_after_the_warm_up():
    settings = PipelineSettings(micro_batches=4, steps=4, warmup_steps=2)
    records = [_record(1, [9.0, 9.0], [1.0, 1.0]), _record(2, [9.0, 9.0], [1.0, 1.0]),
               _record(3, [2.0, 2.0], [1.5, 1.8]), _record(4, [2.0, 2.0], [1.5, 1.8])]
    measure = measure_schedule("pp2-vp2", records, settings, predicted_bubble=1 / 9)
    assert measure.idle_s == pytest.approx([0.5, 0.2])
    assert measure.measured_bubble == pytest.approx((0.25 + 0.1) / 2)
    text = format_doc([measure], settings, "loongforge bench pipeline --schedules pp2-vp2")
    assert "| pp2-vp2 | 4.00 | 2.00 / 2.00 | 0.50 / 0.20 | 17.5% | 11.1% | +6.4 points |" in text
    with pytest.raises(ValueError, match="no step after the 4 warm-up steps"):
        measure_schedule("pp2", records, PipelineSettings(steps=4, warmup_steps=4), predicted_bubble=0.2)


def test_the_prediction_is_the_dry_runs_close_to_equal_stages(tmp_path):
    settings = PipelineSettings()
    for virtual in (1, 2, 4):
        predicted = dry_run_bubble(schedule_config(virtual, tmp_path, settings))
        equal = equal_stage_bubble(2, virtual, settings.micro_batches)
        print(f"VP {virtual}: dry run {predicted:.3f}, equal stages {equal:.3f}")
        assert equal <= predicted < equal + 0.05  # the head's stage is a little heavier


def test_a_real_interleaved_run_logs_each_ranks_schedule(tmp_path):
    settings = PipelineSettings(micro_batches=2, seq_len=128, steps=2, warmup_steps=1)
    (measure,) = run_pipeline_bench(tmp_path, schedules=["pp2-vp2"], settings=settings)
    print(f"pp2-vp2 on a 128-token row: bubble {measure.measured_bubble:.2f} measured, "
          f"{measure.predicted_bubble:.2f} predicted")
    assert len(measure.pipeline_s) == 2 and all(wall > 0 for wall in measure.pipeline_s)
    # CPU seconds can pass the wall where torch runs several threads: only the bound is certain.
    assert all(idle < wall for idle, wall in zip(measure.idle_s, measure.pipeline_s))
    record = json.loads((tmp_path / "pp2-vp2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["pipeline_cpu_s_by_rank"]) == 2


def test_the_command_refuses_an_odd_micro_batch_count():
    result = CliRunner().invoke(app, ["bench", "pipeline", "--micro-batches", "3"])
    assert result.exit_code == 2 and "multiple of PP 2" in result.output
