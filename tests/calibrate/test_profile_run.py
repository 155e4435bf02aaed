"""End to end over gloo: `loongforge profile` records, and the online-fitted model survives resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from tests.train.conftest import PRESET, RUN_TIMEOUT_S, SAVE_AT_END, SMALL_MODEL, assert_quiet_stderr, run_train


def run_profile(output: Path, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "loongforge.cli.app", "profile", "--preset", PRESET,
           *SMALL_MODEL, "--output", str(output), "--nproc-per-node", str(nproc), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert_quiet_stderr(proc.stderr, f"profile --nproc-per-node {nproc}")  # the launcher's and every rank's
    return proc


def test_two_rank_profile_has_one_record_per_rank_per_micro_batch(tmp_path):
    output = tmp_path / "PROFILE.jsonl"
    run_profile(output, "--sweep", "--steps", "3", "--warmup-steps", "1")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert records[0]["kind"] == "env" and records[0]["layout"] == {"tp": 1, "pp": 1, "dp": 2}
    assert records[0]["data"] == "sweep" and records[0]["world_size"] == 2
    mbs = [r for r in records if r["kind"] == "micro_batch"]
    steps = [r for r in records if r["kind"] == "step"]
    # global batch 4 over DP 2: 2 micro-batches per rank per step.
    keys = Counter((r["step"], r["rank"], r["micro_batch"]) for r in mbs)
    assert set(keys) == {(s, r, m) for s in (1, 2, 3) for r in (0, 1) for m in (0, 1)}
    assert set(keys.values()) == {1}
    for r in mbs:
        assert r["forward_s"] > 0 and r["backward_s"] > 0
        assert r["forward_cpu_s"] > 0 and r["backward_cpu_s"] > 0  # a real forward costs CPU time
        assert r["warmup"] == (r["step"] == 1)
        assert r["features"]["sum_L"] == sum(s["L"] for s in r["samples"]) > 0
    assert Counter((r["step"], r["rank"]) for r in steps) == {(s, r): 1 for s in (1, 2, 3) for r in (0, 1)}
    for r in steps:
        assert r["step_s"] >= r["fwd_bwd_s"] >= r["grad_sync_s"] > 0  # the all-reduce takes time
    # The two ranks trained different rows of the same designed step.
    ids = {r["rank"]: [s["L"] for s in r["samples"]] for r in mbs if (r["step"], r["micro_batch"]) == (1, 0)}
    assert ids[0] != ids[1]
    assert not list(tmp_path.glob("*.part"))


def _checkpoint_cost_model(out: Path, step: int):
    state = torch.load(out / "checkpoints" / f"step_{step:08d}" / "rank_00000.pt", weights_only=False)
    return state["extra"].get("cost_model")


def test_online_fit_is_saved_in_checkpoints_and_restored_on_resume(tmp_path):
    out = tmp_path / "run"
    fit = ["balance.fit_steps=4", "balance.fit_warmup_steps=1"]
    first = run_train(out, *fit, "training.train_steps=6", SAVE_AT_END)
    assert "cost model: fitted online at step 5" in first.stderr, first.stderr[-3000:]
    fitted = _checkpoint_cost_model(out, 6)
    assert fitted is not None and fitted["source"] == "fit:online"
    assert fitted["micro_batch_overhead_s"] + sum(fitted["coefficients"].values()) > 0
    # Resumed for one step: too few steps to fit again, so a model in the new checkpoint can only
    # have come from the restored one.
    run_train(out, *fit, "training.train_steps=7", SAVE_AT_END, resume=True)
    assert _checkpoint_cost_model(out, 7) == fitted
