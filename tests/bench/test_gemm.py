"""``loongforge bench gemm``: the layers it times are the shards training builds (from the family's
weight map at the run's TP sizes), the policy keeps the smallest token count from which FP8 stays
faster, and the command writes a policy ``training.fp8=auto`` reads, with its plot."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from loongforge.bench.gemm import at_tensor_parallel, linear_shapes, smallest_winning_tokens
from loongforge.cli.app import app
from loongforge.config.errors import ConfigError
from loongforge.config.loader import load_run_config
from loongforge.models.fp8 import Fp8Policy


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


def test_command_writes_a_policy_auto_reads_and_its_plot(tmp_path):
    policy = tmp_path / "policy.json"
    result = CliRunner().invoke(app, ["bench", "gemm", "--preset", "qwen2.5vl-tiny", "--tokens", "16",
                                      "--steps", "1", "--warmup-steps", "0", "--device", "cpu",
                                      "--output", str(policy)])
    assert result.exit_code == 0, result.output
    assert policy.with_suffix(".png").stat().st_size > 0
    loaded = Fp8Policy.load(policy)
    assert loaded.device == "cpu" and set(loaded.min_tokens) == set(_shapes("qwen2.5vl-tiny", 1))
    assert "| language.fc1 | 1 |" in result.stdout and f"wrote {policy}" in result.stdout
