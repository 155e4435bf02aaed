"""``loongforge bench moe``: grouped-GEMM experts and megatron's SequentialMLP timed on the same weights and routed
rows, at a toy shape on the CPU: both times, their ratio, the weight stacking's share, and equal outputs (the CPU's
grouped function is the same loop of matmuls). The CPU figures at a quarter of Qwen3-30B-A3B's widths:
docs/benchmarks/moe.md."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from loongforge.cli.app import app
from tests.bench.test_model_step import _restore_launch_env_afterwards
from tests.console import assert_no_third_party_warning, console_of


def test_bench_moe_on_cpu(tmp_path, monkeypatch, capfd):
    _restore_launch_env_afterwards(monkeypatch)
    out = tmp_path / "result.json"
    result, stderr = console_of(capfd, lambda: CliRunner().invoke(app, [
        "bench", "moe", "--experts", "8", "--topk", "2", "--hidden", "64", "--ffn", "32", "--tokens", "128",
        "--steps", "1", "--warmup-steps", "0", "--device", "cpu", "--output", str(out)]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "bench moe")
    data = json.loads(out.read_text())
    assert data["shape"] == {"experts": 8, "topk": 2, "hidden": 64, "ffn": 32, "tokens": 128}
    assert data["dtype"] == "fp32" and data["output_relative_diff"] == 0.0
    assert data["sequential_ms"] > 0 and data["grouped_ms"] > data["stack_ms"] > 0
    assert data["speedup"] == pytest.approx(data["sequential_ms"] / data["grouped_ms"])
    # the command as typed (the test process's own arguments under CliRunner: none under xdist)
    assert "| grouped (GroupedExperts) |" in result.output and data["command"].split()[0] == "loongforge"


@pytest.mark.parametrize("args, message", [
    (["--topk", "9", "--experts", "8"], "--topk 9 is more than --experts 8"),
    (["--dtype", "fp16"], "--dtype 'fp16' is not one of bf16 | fp32"),
])
def test_usage_errors_exit_2(args, message):
    result = CliRunner().invoke(app, ["bench", "moe", "--device", "cpu", *args])
    assert result.exit_code == 2 and message in result.output, result.output
