"""`loongforge bench train`: the off/on comparison from profile records, and its command line.

The training runs themselves are `loongforge profile` runs (tested in tests/profile); here the
records are written by hand so every figure is known exactly."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from loongforge.balance.cost_model import TERMS, CostModel
from loongforge.bench.train import compare_runs, measure_run
from loongforge.cli.app import app
from loongforge.config.loader import load_run_config
from loongforge.models.registry import get_family
from loongforge.profile.features import record_samples
from loongforge.models.flops import FlopOptions
from loongforge.profile.profile_file import PROFILE_FORMAT, read_profile

# Cost model: 1 s per loss token, nothing else, so predictions are the features' n_loss.
MODEL = CostModel({t: 0.0 for t in TERMS} | {"n_loss": 1.0})
CFG = load_run_config("llm-tiny", overrides=["logging.peak_tflops=0.002"])


def _records(per_step: list[list[tuple[float, float]]], overhead_s: float = 0.5) -> list[dict]:
    """per_step[s][rank] = (measured compute seconds, predicted seconds); step 0 is warm-up."""
    records = [{"kind": "env", "format": PROFILE_FORMAT, "device": "cpu", "dtype": "fp32",
                "preset": "test", "model": {"size": 1}}]
    for step, ranks in enumerate(per_step):
        slowest = max(measured for measured, _ in ranks)
        for rank, (measured, predicted) in enumerate(ranks):
            features = dict.fromkeys(TERMS, 0.0) | {"n_loss": predicted}
            records.append({"kind": "micro_batch", "step": step, "rank": rank, "dp_rank": rank,
                            "warmup": step == 0, "micro_batch": 0, "features": features,
                            "samples": [{"L": 200, "patches": [], "loss": 50}],
                            "forward_s": measured / 3, "backward_s": measured * 2 / 3})
            records.append({"kind": "step", "step": step, "rank": rank, "warmup": step == 0,
                            "step_s": slowest + overhead_s, "fwd_bwd_s": slowest})
    return records


OFF = [[(9.0, 9.0), (9.0, 9.0)], [(3.0, 3.0), (1.0, 1.0)], [(6.0, 6.0), (2.0, 2.0)]]  # max/mean 1.5
ON = [[(9.0, 9.0), (9.0, 9.0)], [(2.2, 2.0), (1.8, 2.0)], [(4.0, 4.0), (4.0, 4.0)]]  # 1.1 and 1.0


def _write(path, per_step):
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(per_step)))
    return path


def test_measured_and_predicted_gains_from_per_rank_records(tmp_path):
    off = measure_run("off", read_profile([_write(tmp_path / "off.jsonl", OFF)]), MODEL, CFG)
    on = measure_run("on", read_profile([_write(tmp_path / "on.jsonl", ON)]), MODEL, CFG)
    assert off.steps == on.steps == 2  # the warm-up step is left out
    assert off.max_over_mean == pytest.approx(1.5)
    assert on.max_over_mean == pytest.approx((1.1 + 1.0) / 2)
    assert off.predicted_max_over_mean == pytest.approx(1.5) and on.predicted_max_over_mean == pytest.approx(1.0)
    assert off.wait_s == pytest.approx((1.0 + 2.0) / 2)  # per rank: (2 + 0) / 2 and (4 + 0) / 2
    assert off.wait_by_rank_s == pytest.approx([0.0, 3.0])
    assert off.step_s == pytest.approx((3.5 + 6.5) / 2)
    # Model FLOPs: each of 2 ranks ran one 200-token sample (50 loss tokens) per measured step.
    record = next(r for r in read_profile([tmp_path / "off.jsonl"]).micro_batches)
    per_micro_batch = get_family("llm").training_flops(CFG.model, record_samples(record), FlopOptions()).total
    assert off.model_tflops_per_gpu == pytest.approx(2 * 2 * per_micro_batch / (3.5 + 6.5) / 2 / 1e12)
    assert off.mfu == pytest.approx(off.model_tflops_per_gpu / 0.002) and off.encoder_flops_share == 0.0
    result = compare_runs(off, on)
    assert result.measured_balance_gain == pytest.approx(1.5 / 1.05 - 1)
    assert result.predicted_balance_gain == pytest.approx(0.5)
    assert result.gap_pp == pytest.approx(100 * (1.5 / 1.05 - 1.5))
    assert result.work_drift == pytest.approx(0.0)  # the same work in both runs
    assert result.measured_step_gain == pytest.approx(5.0 / 3.6 - 1)


def test_a_slower_machine_in_one_run_shows_as_drift_not_as_balance_gain(tmp_path):
    slower = [[(m * 1.2, p) for m, p in ranks] for ranks in OFF]  # same plan, 20% slower machine
    off = measure_run("off", read_profile([_write(tmp_path / "off.jsonl", OFF)]), MODEL, CFG)
    slow = measure_run("on", read_profile([_write(tmp_path / "on.jsonl", slower)]), MODEL, CFG)
    result = compare_runs(off, slow)
    assert result.work_drift == pytest.approx(0.2)
    assert result.measured_balance_gain == pytest.approx(0.0)
    assert result.measured_step_gain < -0.1


def test_report_only_rebuilds_the_report_and_usage_errors_exit_2(tmp_path):
    runner = CliRunner()
    missing_cost = runner.invoke(app, ["bench", "train", "--out", str(tmp_path)])
    assert missing_cost.exit_code == 2 and "--cost COST.json is required" in missing_cost.output
    cost = tmp_path / "COST.json"
    MODEL.save(cost)
    no_profiles = runner.invoke(app, ["bench", "train", "--cost", str(cost), "--out", str(tmp_path),
                                      "--report-only"])
    assert no_profiles.exit_code == 2 and "off.jsonl" in no_profiles.output
    _write(tmp_path / "off.jsonl", OFF)
    _write(tmp_path / "on.jsonl", ON)
    bad_order = runner.invoke(app, ["bench", "train", "--cost", str(cost), "--out", str(tmp_path),
                                    "--order", "sideways"])
    assert bad_order.exit_code == 2 and "--order" in bad_order.output
    result = runner.invoke(app, ["bench", "train", "--cost", str(cost), "--out", str(tmp_path), "--report-only"])
    assert result.exit_code == 0, result.output
    assert "predicted +50.00%" in result.output
    saved = json.loads((tmp_path / "train.json").read_text())
    assert saved["predicted_balance_gain"] == pytest.approx(0.5) and saved["order"] == "off-on"
    assert (tmp_path / "train.png").stat().st_size > 10_000 and "| balance off |" in (tmp_path / "train.md").read_text()
