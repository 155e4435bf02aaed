"""scripts/gpu_check.py (the checks and the report behind scripts/gpu_check.sh) on hand-written step
outputs, and the shell script's command line. The whole script runs in CI as
`bash scripts/gpu_check.sh --cpu-rehearsal` (.ci/run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_outputs(work: Path, losses: list[float], resumed_at: int = 20) -> None:
    (work / "train").mkdir(parents=True)
    (work / "train" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    (work / "a_train.log").write_text(f"resumed from /x/step_{resumed_at:08d} at step {resumed_at}\n")
    (work / "a_train.cmds").write_text("loongforge train --preset qwen2.5vl-tiny\n")


def _check(gpu_check, work: Path, step: str, rc: int = 0, *extra: str) -> int:
    return gpu_check.main(["check", step, "--work", str(work), "--rc", str(rc), "--seconds", "12",
                           "--timeout", "100", *extra])


def test_train_passes_when_every_step_is_logged_once_resumed_and_the_loss_falls(gpu_check, tmp_path, capsys):
    _train_outputs(tmp_path, [12.0 - 0.3 * i for i in range(30)])
    assert _check(gpu_check, tmp_path, "a_train") == 0
    assert capsys.readouterr().out.startswith("PASS a. train")
    record = json.loads((tmp_path / "a_train.status.json").read_text())
    assert record["passed"] and record["figures"]["resumed_at"] == 20
    assert record["commands"] == ["loongforge train --preset qwen2.5vl-tiny"]


@pytest.mark.parametrize("losses, resumed_at, rc", [
    ([12.0] * 30, 20, 0),  # flat loss
    ([12.0 - 0.3 * i for i in range(29)], 20, 0),  # a step missing
    ([12.0 - 0.3 * i for i in range(30)], 19, 0),  # resumed at the wrong step
    ([12.0 - 0.3 * i for i in range(30)], 20, 124),  # timed out
])
def test_train_fails(gpu_check, tmp_path, capsys, losses, resumed_at, rc):
    _train_outputs(tmp_path, losses, resumed_at)
    assert _check(gpu_check, tmp_path, "a_train", rc) == 1
    assert capsys.readouterr().out.startswith("FAIL")


def test_a_step_that_left_no_files_fails_with_the_reason(gpu_check, tmp_path, capsys):
    assert _check(gpu_check, tmp_path, "b_parity", 1) == 1
    assert "no result (FileNotFoundError" in capsys.readouterr().out


def test_parity_and_cost_thresholds(gpu_check, tmp_path):
    parity = {"device": "cuda:0", "backend": "cpu:gloo,cuda:nccl", "collectives": {"cpu": "ok", "cuda": "ok"},
              "tolerance": 1e-4, "max_abs_diff": {"text": 3e-5, "image": 2e-4}}
    (tmp_path / "b_parity.result.json").write_text(json.dumps(parity))
    assert _check(gpu_check, tmp_path, "b_parity") == 1
    parity["max_abs_diff"]["image"] = 5e-5
    (tmp_path / "b_parity.result.json").write_text(json.dumps(parity))
    assert _check(gpu_check, tmp_path, "b_parity") == 0
    # The regression the step exists for: an NCCL-only group refuses the CPU bookkeeping's tensors.
    parity["collectives"]["cpu"] = "RuntimeError: No backend type associated with device type cpu"
    (tmp_path / "b_parity.result.json").write_text(json.dumps(parity))
    assert _check(gpu_check, tmp_path, "b_parity") == 1
    accuracy = {"held_out_micro_batch": {"median_ape_pct": 4.2, "p90_ape_pct": 9.0},
                "comparison": {"nnls": {"cross_validated": {"micro_batch": {"median_ape_pct": 4.5}}}}}
    (tmp_path / "e_cost.json").write_text(json.dumps({"accuracy": accuracy, "environment": {"device": "H200"}}))
    assert _check(gpu_check, tmp_path, "e_cost", 0, "--target", "5") == 0
    assert _check(gpu_check, tmp_path, "e_cost", 0, "--target", "4") == 1
    assert _check(gpu_check, tmp_path, "e_cost") == 0  # the rehearsal reports without a target
    figures = json.loads((tmp_path / "e_cost.status.json").read_text())["figures"]
    assert figures["held_out_median_ape_pct"] == 4.2 and figures["cross_validated_median_ape_pct"] == 4.5


def _moe_outputs(work: Path, losses: list[float], balance: float = 2.1, speedup: float = 2.5) -> None:
    (work / "moe").mkdir(parents=True)
    (work / "moe" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "loss": loss, "load_balancing_loss": balance,
                    "expert_load_max_over_mean": 1.4}) + "\n" for i, loss in enumerate(losses)))
    (work / "f_moe.log").write_text("layers: language sdpa (local norm-linear and linears; experts: grouped)\n")
    (work / "f_bench.result.json").write_text(json.dumps({
        "shape": {"experts": 128, "topk": 8, "hidden": 2048, "ffn": 768, "tokens": 8192}, "dtype": "bf16",
        "sequential_ms": 10.0 * speedup, "grouped_ms": 10.0, "speedup": speedup, "stack_ms": 1.0,
        "output_relative_diff": 4e-3}))


@pytest.mark.parametrize("losses, balance, passed", [
    ([12.0 - 0.2 * i for i in range(20)], 2.1, True),
    ([12.0] * 20, 2.1, False),  # the loss does not fall
    ([12.0 - 0.2 * i for i in range(19)], 2.1, False),  # a step missing
    ([12.0 - 0.2 * i for i in range(20)], float("nan"), False),  # the balance loss is not finite
])
def test_moe_step(gpu_check, tmp_path, losses, balance, passed):
    _moe_outputs(tmp_path, losses, balance)
    assert _check(gpu_check, tmp_path, "f_moe", 0, "--steps", "20", "--max-loss-ratio", "0.95") == (0 if passed else 1)


@pytest.mark.parametrize("speedup, experts, passed", [
    (2.5, "grouped", True),
    (1.5, "grouped", False),  # grouped experts below issue 54's 1.8x
    (2.5, "sequential", False),  # the run's layers line names other experts
])
def test_moe_step_times_grouped_experts(gpu_check, tmp_path, speedup, experts, passed):
    _moe_outputs(tmp_path, [12.0 - 0.2 * i for i in range(20)], speedup=speedup)
    assert _check(gpu_check, tmp_path, "f_moe", 0, "--steps", "20", "--max-loss-ratio", "0.95", "--experts", experts,
                  "--min-speedup", "1.8") == (0 if passed else 1)
    figures = json.loads((tmp_path / "f_moe.status.json").read_text())["figures"]
    assert figures["grouped_speedup"] == speedup


def _fp8_outputs(work: Path, bf16_rate: float, fp8_rate: float, fp8_final: float, fc1_tokens=2048) -> None:
    (work / "fp8").mkdir(parents=True)
    policy = {"layers": {"language.fc1": {"1": {"min_tokens": fc1_tokens, "recipe": "rowwise"}},
                         "vision.qkv": {"1": {"min_tokens": None, "recipe": None}}}, "torchao_unmeasured": None}
    (work / "fp8" / "policy_tp1.json").write_text(json.dumps(policy))
    for mode, rate, final in (("off", bf16_rate, 2.0), ("auto", fp8_rate, fp8_final)):
        (work / "fp8" / f"train_{mode}").mkdir()
        (work / "fp8" / f"train_{mode}" / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "loss": 4.0 - (4.0 - final) * i / 99, "tokens_per_s": rate}) + "\n"
            for i in range(100)))
    (work / "g_fp8.log").write_text("fp8: auto, per layer kind from policy_tp1.json (measured on H200): language.fc1 4/4\n")


@pytest.mark.parametrize("fp8_rate, fp8_final, fc1_tokens, passed", [
    (12_000.0, 2.01, 2048, True),  # 1.2x, 0.5% loss difference
    (10_500.0, 2.01, 2048, False),  # 1.05x: below the 1.15x target
    (12_000.0, 2.1, 2048, False),  # 5% loss difference
    (10_000.0, 2.0, None, True),  # the policy measured bf16 faster everywhere and says so: auto is bf16
])
def test_fp8_step(gpu_check, tmp_path, fp8_rate, fp8_final, fc1_tokens, passed):
    _fp8_outputs(tmp_path, 10_000.0, fp8_rate, fp8_final, fc1_tokens)
    rc = _check(gpu_check, tmp_path, "g_fp8", 0, "--steps", "100", "--min-ratio", "1.15", "--max-loss-diff", "0.01")
    assert rc == (0 if passed else 1)
    figures = json.loads((tmp_path / "g_fp8.status.json").read_text())["figures"]
    assert figures["fp8_kinds_by_tp"] == {"1": ["language.fc1 (rowwise)"] if fc1_tokens else []}
    assert figures["policy_bf16_everywhere"] == (fc1_tokens is None)
    assert figures["ratio"] == pytest.approx(fp8_rate / 10_000.0)


def _hybrid_outputs(work: Path, rule: str, worst: float, losses: list[float]) -> None:
    (work / "h_rule.result.json").write_text(json.dumps({"rule": rule, "tolerance": 5e-3, "relative_diff": {
        "out": worst, "dq": worst / 2, "dk": worst / 3, "dv": worst / 4}}))
    (work / "hybrid").mkdir(parents=True)
    (work / "hybrid" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    growth = {variant: [{"seq_len": 2048, "time_ratio": 1.0}, {"seq_len": 32768, "time_ratio": ratio}]
              for variant, ratio in (("hybrid", 20.0), ("all_attention", 90.0), ("all_linear", 16.5))}
    (work / "h_bench.result.json").write_text(json.dumps({"options": {"seq_lens": [2048, 32768]}, "rows": [],
                                                          "growth": growth}))


@pytest.mark.parametrize("rule, worst, losses, passed", [
    ("fla", 1e-3, [8.0 - 0.2 * i for i in range(20)], True),
    ("torch", 1e-7, [8.0 - 0.2 * i for i in range(20)], False),  # fla expected on the GPU: not picked
    ("fla", 2e-2, [8.0 - 0.2 * i for i in range(20)], False),  # the kernel differs from the rule
    ("fla", 1e-3, [8.0] * 20, False),  # the loss does not fall
])
def test_hybrid_step(gpu_check, tmp_path, capsys, rule, worst, losses, passed):
    _hybrid_outputs(tmp_path, rule, worst, losses)
    rc = _check(gpu_check, tmp_path, "h_hybrid", 0, "--steps", "20", "--max-loss-ratio", "0.9", "--rule", "fla")
    assert rc == (0 if passed else 1)
    line = capsys.readouterr().out
    assert f"rule {rule} (expected fla)" in line and "all_linear x16.5" in line


VARLEN_ROW = {"tokens": 8192, "segments": 9, "heads": 28, "groups": 4, "head_dim": 128, "dtype": "bfloat16",
              "tolerance": 2e-2, "sdpa_ms": 9.0, "auto_backend": "varlen"}


@pytest.mark.parametrize("ran, worst, speedup, kernel, passed", [
    (True, 4e-3, 3.0, "varlen", True),
    (True, 5e-2, 3.0, "varlen", False),  # the kernel differs from SDPA beyond bf16 rounding
    (True, 4e-3, 0.9, "varlen", False),  # slower than SDPA per segment (--min-ratio 1)
    (False, None, None, "varlen", False),  # varlen expected on the GPU: it did not run
    (False, None, None, "sdpa", True),  # the rehearsal: SDPA alone, as expected
])
def test_varlen_step(gpu_check, tmp_path, capsys, ran, worst, speedup, kernel, passed):
    result = dict(VARLEN_ROW)
    if ran:
        result.update(relative_diff={"out": worst, "dq": worst / 2}, varlen_ms=9.0 / speedup, speedup=speedup)
    else:
        result.update(auto_backend="sdpa", varlen="not run: model.layer_backend='varlen' needs a CUDA device")
    (tmp_path / "i_varlen.result.json").write_text(json.dumps(result))
    rc = _check(gpu_check, tmp_path, "i_varlen", 0, "--kernel", kernel, "--min-ratio", "1")
    assert rc == (0 if passed else 1)
    line = capsys.readouterr().out
    assert "8192 tokens in 9 samples, 28 heads / 4 groups x 128, bfloat16" in line


def _compile_result(part: str, tokens: int, eager_ms: float, compiled_ms: float, worst: float) -> dict:
    return {"part": part, "tokens": tokens, "dtype": "bfloat16", "first_call_s": 3.0, "worst": worst,
            "eager_worst": 4e-3, "worst_summed": 0.0, "eager_ms": eager_ms, "compiled_ms": compiled_ms}


@pytest.mark.parametrize("worst, passed", [(8e-3, True), (5e-2, False)])  # bf16 rounding; beyond it
def test_compile_step_names_the_parts_that_pay(gpu_check, tmp_path, capsys, worst, passed):
    results = [_compile_result("norm", 1024, 1.0, 0.8, 1e-3), _compile_result("norm", 8192, 8.0, 4.0, worst),
               _compile_result("permute", 8192, 2.0, 2.5, 1e-3)]
    (tmp_path / "j_compile.result.json").write_text(json.dumps(
        {"device": "cuda", "dtype": "bfloat16", "tolerance": 2e-2, "auto": ["norm", "permute"], "results": results}))
    assert _check(gpu_check, tmp_path, "j_compile", 0) == (0 if passed else 1)
    assert "at 8192 tokens (bfloat16): norm x2.00, permute x0.80" in capsys.readouterr().out
    figures = json.loads((tmp_path / "j_compile.status.json").read_text())["figures"]
    assert figures["faster_compiled"] == ["norm"]


def test_report_lists_every_step_with_its_commands(gpu_check, tmp_path):
    _train_outputs(tmp_path, [12.0 - 0.3 * i for i in range(30)])
    _check(gpu_check, tmp_path, "a_train")
    _check(gpu_check, tmp_path, "d_pytest", 1)
    (tmp_path / "machine.json").write_text(json.dumps({"date": "2026-01-01 00:00 UTC", "device": "H200"}))
    report = tmp_path / "gpu.md"
    assert gpu_check.main(["report", "--work", str(tmp_path), "--output", str(report)]) == 1
    text = report.read_text()
    assert f"2026-01-01 00:00 UTC: 1/{len(gpu_check.STEPS)} steps passed" in text and "Machine: device H200" in text
    assert "| a. train qwen2.5vl-tiny, save, resume | PASS |" in text and "| d. CPU test suite" in text
    assert "```bash\nloongforge train --preset qwen2.5vl-tiny\n```" in text
    assert json.loads((tmp_path / "gpu_results.json").read_text())["steps"][1]["passed"] is False


def test_shell_script_parses_and_rejects_unknown_flags():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    result = subprocess.run(["bash", str(SCRIPT), "--gpu"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash scripts/gpu_check.sh" in result.stderr


def test_the_parity_step_runs_on_cpu_within_its_tolerance(gpu_check):
    """The GPU run's parity step, on CPU: catches a moved import or a broken helper before the one
    GPU call of a session does (the CI rehearsal runs it too, but only after the whole suite)."""
    import torch

    from tests.models.helpers import destroy_megatron, free_port, init_megatron

    init_megatron(rank=0, world_size=1, port=free_port())
    try:
        collectives = gpu_check._collectives(SimpleNamespace(device=torch.device("cpu")))
        diffs = gpu_check._parity_diffs(torch.device("cpu"))
    finally:
        destroy_megatron()
    assert collectives == {"cpu": "ok"}
    assert set(diffs) == set(gpu_check.PARITY_CASES)
    assert max(diffs.values()) < gpu_check.PARITY_TOLERANCE
