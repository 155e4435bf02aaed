"""``loongforge bench hybrid``: a hybrid decoder and its all-attention twin timed at each length in one run;
the hybrid variant keeps the preset's layer pattern, the twin has no linear layer; the model FLOPs of the
twin grow faster than the hybrid's (attention's square in L); activation memory is counted on the CPU."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from loongforge.cli.app import app
from tests.bench.test_model_step import _restore_launch_env_afterwards
from tests.console import assert_no_third_party_warning, console_of


def test_bench_hybrid_on_cpu(tmp_path, monkeypatch, capfd):
    _restore_launch_env_afterwards(monkeypatch)
    out = tmp_path / "result.json"
    result, stderr = console_of(capfd, lambda: CliRunner().invoke(app, [
        "bench", "hybrid", "--seq-lens", "128,512", "--steps", "1", "--warmup-steps", "1", "--device", "cpu",
        "--output", str(out), "--json"]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "bench hybrid")
    data = json.loads(out.read_text())
    assert data["layer_types"]["hybrid"] == ["linear_attention"] * 3 + ["full_attention"]
    assert data["layer_types"]["all_attention"] == ["full_attention"] * 4
    assert data["layer_types"]["all_linear"] == ["linear_attention"] * 4
    variants = ("hybrid", "all_attention", "all_linear")
    rows = {(row["variant"], row["seq_len"]): row for row in data["rows"]}
    assert set(rows) == {(variant, length) for variant in variants for length in (128, 512)}
    growth = {variant: rows[variant, 512]["model_tflop"] / rows[variant, 128]["model_tflop"] for variant in variants}
    print("\nmodel FLOPs from 128 to 512 tokens: " + ", ".join(f"{v} x{g:.3f}" for v, g in growth.items()))
    assert growth["all_linear"] == pytest.approx(4.0)  # linear layers: linear in L
    assert growth["all_linear"] < growth["hybrid"] < growth["all_attention"]
    assert all(row["saved_for_backward_gib"] > 0 and row["step_s_median"] > 0 for row in data["rows"])


@pytest.mark.parametrize("args, message", [
    (["--seq-lens", "2k"], "give whole token counts"),
    (["--preset", "qwen3vl-tiny"], "layer_types is empty"),
])
def test_usage_errors_exit_2(args, message):
    result = CliRunner().invoke(app, ["bench", "hybrid", "--device", "cpu", *args])
    assert result.exit_code == 2 and message in result.output, result.output
