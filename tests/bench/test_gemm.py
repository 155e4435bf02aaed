"""``loongforge bench gemm``: the layers it times are the shards training builds (from the family's
weight map at the run's TP sizes), the policy keeps the smallest token count from which FP8 stays
faster, and the command writes a policy ``training.fp8=auto`` reads, with its plot."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from loongforge.bench.gemm import GemmBench, at_tensor_parallel, linear_shapes, smallest_winning_tokens
from loongforge.bench.gemm_linear import whole_linear
from loongforge.cli.app import app
from loongforge.config.errors import ConfigError
from loongforge.config.loader import load_run_config
from loongforge.models.layers.fp8 import Fp8Policy
from tests.console import assert_no_third_party_warning, console_of


def _shapes(preset: str, tp: int) -> dict:
    cfg = at_tensor_parallel(load_run_config(preset), tp)
    return {s.kind: (s.tp, s.out_features, s.in_features, s.run_tokens) for s in linear_shapes(cfg)}


def test_qwen2_5_vl_7b_layers_at_tp_1_and_2():
    # Qwen2.5-VL-7B: hidden 3584, 28 heads / 4 KV heads of 128, MLP 18944; ViT width 1280, MLP 3420
    # (SwiGLU), merger 5120 -> 3584; 8192-token rows; at most 12,845,056 pixels = 65,536 patches.
    one, two = _shapes("qwen2.5vl-7b", 1), _shapes("qwen2.5vl-7b", 2)
    seq = load_run_config("qwen2.5vl-7b").data.seq_len
    assert one["language.qkv"] == (1, (28 + 2 * 4) * 128, 3584, seq)
    assert two["language.qkv"] == (2, (28 + 2 * 4) * 128 // 2, 3584, seq)
    assert two["language.proj"] == (2, 3584, 3584 // 2, seq)
    assert two["language.fc1"] == (2, 2 * 18944 // 2, 3584, seq)
    assert two["language.fc2"] == (2, 3584, 18944 // 2, seq)
    assert one["vision.qkv"][1:3] == (3 * 1280, 1280) and two["vision.qkv"][1:3] == (3 * 1280 // 2, 1280)
    assert two["vision.fc1"][1:3] == (2 * 3420 // 2, 1280) and two["vision.fc2"][1:3] == (1280, 3420 // 2)
    assert two["projector.fc1"][1:3] == (5120 // 2, 5120) and two["projector.fc2"][1:3] == (3584, 5120 // 2)
    assert one["projector.fc1"][3] * 4 == one["vision.qkv"][3]  # merged 2 x 2


def test_moe_experts_are_their_own_kinds_at_expert_tp():
    shapes = _shapes("qwen3vl-30b-a3b", 2)  # expert TP 1, 128 experts of width 768, top-8
    assert shapes["language.expert_fc1"][:3] == (1, 2 * 768, 2048)
    assert shapes["language.expert_fc2"][:3] == (1, 2048, 768)
    assert shapes["language.expert_fc1"][3] == 16384 * 8 // 128


def test_a_tp_the_model_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="--tp=3"):
        at_tensor_parallel(load_run_config("qwen2.5vl-7b"), 3)


@pytest.mark.parametrize("speedups, expected", [
    ({256: 0.8, 1024: 1.02, 4096: 1.2, 16384: 1.4}, 4096),
    ({256: 1.1, 1024: 0.9, 4096: 1.2}, 4096),  # a dip below: FP8 only from above it
    ({256: 1.3, 1024: 1.2}, 256),
    ({256: 1.3, 1024: 1.01}, None),  # not faster at the largest
])
def test_smallest_winning_tokens(speedups, expected):
    timings = [{"tokens": t, "speedup": s} for t, s in speedups.items()]
    assert smallest_winning_tokens(timings, 1.05) == expected


def test_command_writes_a_policy_auto_reads_and_its_plot(tmp_path, capfd):
    """At TP 2 with sequence parallelism: the GEMM rows, and the whole layer (megatron's linear in two
    processes over gloo, its gather and reduce-scatter around the FP8 GEMMs) deciding each kind's
    policy, its weight quantised once per step of 2 micro-batches, FP8 really run (its error)."""
    policy = tmp_path / "policy.json"
    result, stderr = console_of(capfd, lambda: CliRunner().invoke(app, [
        "bench", "gemm", "--preset", "qwen2.5vl-tiny", "--tp", "2", "--sequence-parallel", "--tokens", "16", "--steps",
        "1", "--warmup-steps", "1", "--micro-batches", "2", "--device", "cpu", "--output", str(policy)]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "bench gemm --tp 2")  # this process's and its measuring processes'
    assert policy.with_suffix(".png").stat().st_size > 0
    loaded = Fp8Policy.load(policy)
    assert loaded.device == "cpu" and set(loaded.min_tokens) == set(_shapes("qwen2.5vl-tiny", 2))
    assert "| language.fc1 | 2 |" in result.stdout and f"wrote {policy}" in result.stdout
    assert "| language.fc1 | 2 | yes | 16 | 2 |" in result.stdout and "| vision.fc1 | 2 | no | 16 | 2 |" in result.stdout
    layers = json.loads(policy.read_text())["layers"]
    for kind, by_tp in layers.items():
        entry = by_tp["2"]
        (whole,) = entry["linear_timings"]
        print(f"{kind}: whole linear fp8 relative error {whole['relative_error']:.2e}, "
              f"weight quantisations per step {whole['weight_quantisations_per_step']}")
        assert entry["decided_by"] == "linear" and entry["sequence_parallel"] == kind.startswith("language.")
        assert whole["weight_quantisations_per_step"] == 1.0  # once per step, not per micro-batch (2.0)
        assert 1e-3 < whole["relative_error"] < 0.12  # measured ~0.037: FP8 ran, and ran right


def test_whole_linears_are_the_layers_training_builds():
    cfg = at_tensor_parallel(load_run_config("qwen3vl-30b-a3b"), 2, sequence_parallel=True)
    layers = {s.kind: whole_linear(s, cfg) for s in linear_shapes(cfg)}
    assert layers["language.qkv"].column and layers["language.qkv"].sequence_parallel
    assert not layers["language.proj"].column and layers["language.proj"].sequence_parallel
    assert layers["language.expert_fc1"].expert and not layers["language.expert_fc1"].sequence_parallel
    assert not layers["vision.fc1"].sequence_parallel  # the vision tower never splits its sequence
    assert not any(layer.sequence_parallel for layer in
                   (whole_linear(s, at_tensor_parallel(cfg, 1)) for s in linear_shapes(at_tensor_parallel(cfg, 1))))


def test_the_gemm_rows_decide_only_where_the_whole_linear_was_not_timed():
    cfg = at_tensor_parallel(load_run_config("qwen2.5vl-tiny"), 1)
    shapes = [s for s in linear_shapes(cfg) if s.kind in ("language.fc1", "language.fc2")]
    bench = GemmBench(preset="t", device="cpu", shapes=shapes,
                      timings={"language.fc1": [{"tokens": 64, "bf16_ms": 1.5, "fp8_ms": 1.0}],
                               "language.fc2": [{"tokens": 64, "bf16_ms": 1.5, "fp8_ms": 1.0}]},
                      linear_timings={"language.fc1": [{"tokens": 64, "bf16_ms": 0.9, "fp8_ms": 1.0}]})
    layers = bench.policy()["layers"]
    assert layers["language.fc1"]["1"]["decided_by"] == "linear" and layers["language.fc1"]["1"]["min_tokens"] is None
    assert layers["language.fc2"]["1"]["decided_by"] == "gemms" and layers["language.fc2"]["1"]["min_tokens"] == 64
    assert layers["language.fc2"]["1"]["recipe"] == "scaled_mm" and layers["language.fc1"]["1"]["recipe"] is None
