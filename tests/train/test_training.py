"""End-to-end training on CPU over gloo: the baseline learns, resume is exact, real data trains.

The one end-to-end run at the full vocabulary (the default preset, qwen2.5vl-tiny, as a user runs it)
is here; every other training test trains the small-vocabulary variant. Here resume is shown exact
for one process (a copy of the baseline cut back to step 2, resumed). That every parallel layout
reproduces the single-process math, and that a multi-rank run resumes bit for bit (losses, grad norms
and the final checkpoint) at vision TP below language TP, with the distributed optimizer and at PP 2,
is test_layout_invariance.py; vision TP 1 under language TP 2 resumes in test_encoder_dp_full_train.py
and test_encoder_dp_train.py, balanced DP 2 in test_balance_train.py.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from loongforge.config.loader import load_resolved_config
from loongforge.convert.checkpoint_folders import step_dir_name
from loongforge.train.optim import build_scheduler
from tests.train.conftest import (
    SAVE_AT_END,
    assert_quiet_stderr,
    checkpoint_differences,
    cut_back_copy,
    grad_norms,
    losses,
    resume_from_copy,
    run_train,
    step_metric,
)


FULL_VOCABULARY_STEPS = 2


@pytest.fixture(scope="module")
def full_vocabulary_run(tmp_path_factory):
    """The default preset as it ships (the full Qwen vocabulary), on the tests' small settings for 2 steps (the
    second after an update: the loss falls; each full-vocabulary step costs about three small ones); console
    output kept beside it (``<run>.stdout``, ``<run>.stderr``)."""
    out = tmp_path_factory.mktemp("full_vocabulary")
    proc = run_train(out, f"training.train_steps={FULL_VOCABULARY_STEPS}", preset="qwen2.5vl-tiny")
    out.with_suffix(".stdout").write_text(proc.stdout)
    out.with_suffix(".stderr").write_text(proc.stderr)
    return out


@pytest.mark.parametrize("run_name", ["full_vocabulary_run", "baseline_run"])
def test_run_learns_and_leaves_run_files(run_name, request):
    run = request.getfixturevalue(run_name)
    values = losses(run)
    print(f"{run_name}: losses {values}")
    assert len(values) == (FULL_VOCABULARY_STEPS if run_name == "full_vocabulary_run" else 4)
    assert all(math.isfinite(v) for v in values)
    assert values[-1] < values[0], values
    # The full vocabulary starts near ln(151,936) = 11.9, the small one near ln(4,224) = 8.3.
    expected_start = 11.9 if run_name == "full_vocabulary_run" else 8.3
    assert abs(values[0] - expected_start) < 0.3, values
    for name in ("config.yaml", "command.txt", "environment.json", "summary.json"):
        assert (run / name).is_file(), name
    env = json.loads((run / "environment.json").read_text())
    assert env["layout"] == {"tp": 1, "pp": 1, "dp": 1} and "torch" in env["versions"]
    if run_name == "baseline_run":  # the only one that saves
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"


def test_default_run_opens_with_a_summary_and_shows_no_third_party_warning(full_vocabulary_run):
    baseline_run = full_vocabulary_run
    stdout = baseline_run.with_suffix(".stdout").read_text().splitlines()
    stderr = baseline_run.with_suffix(".stderr").read_text()
    assert "Warning" not in stderr and "warnings.warn" not in stderr, stderr
    assert_quiet_stderr(stderr, "train, fresh")
    assert [line.split(":")[0] for line in stdout[:4]] == ["run", "data", "balance", "layers"]
    assert stdout[0].startswith("run: preset qwen2.5vl-tiny | 1 process, TP1 x PP1 x DP1 on cpu | output ")
    assert stdout[1] == "data: synthetic, 96 samples per epoch" and stdout[2] == "balance: off"
    # Every step line and the summary carry the throughput; on the CPU MFU and HFU are n/a.
    assert all("TFLOP/s/GPU | MFU n/a | HFU n/a | encoder " in line for line in stdout if line.startswith("step "))
    summary = json.loads((baseline_run / "summary.json").read_text())
    assert summary["model_tflops_per_gpu"] > 0 and summary["mfu"] is None and summary["hfu"] is None
    # No recompute: the hardware FLOPs are the model FLOPs.
    assert summary["hardware_tflops_per_gpu"] == summary["model_tflops_per_gpu"]
    assert 0 < summary["encoder_flops_share"] < 0.5


def test_resume_gives_identical_losses(baseline_run, tmp_path):
    resumed = tmp_path / "resumed"
    proc = resume_from_copy(baseline_run, resumed, 2, "checkpoint.save_interval=2", SAVE_AT_END)
    # torch.distributed.checkpoint's FutureWarnings on megatron's load used to print here (issue 30).
    assert_quiet_stderr(proc.stderr, "train --resume")
    assert losses(resumed) == losses(baseline_run)
    assert grad_norms(resumed) == grad_norms(baseline_run)
    worst = max(checkpoint_differences(resumed, baseline_run).values())
    print(f"resumed at step 2: losses and grad norms equal, final checkpoint max difference {worst}")
    assert worst == 0.0


# The baseline's 4 steps resumed at step 4 for 4 more, at twice the peak LR and in another data order.
EXTENDED = ("checkpoint.save_interval=2", SAVE_AT_END, "training.train_steps=8", "optimizer.lr=2e-3",
            "data.seed=7", "data.accept_new_order=true")


@pytest.fixture(scope="module")
def extended_resume(baseline_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("extended") / "run"
    proc = resume_from_copy(baseline_run, out, 4, *EXTENDED)
    return out, proc.stdout


def _fresh_schedule_lrs(config_path, steps: range) -> list[float]:
    """The LR a fresh run of ``config_path``'s config trains each of ``steps`` (1-based) at."""
    cfg = load_resolved_config(config_path)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.schedule, train_steps=cfg.training.train_steps)
    lrs = {}
    for step in range(1, max(steps) + 1):
        lrs[step] = optimizer.param_groups[0]["lr"]  # the step's update runs at it, then the schedule moves
        scheduler.step(increment=1)
    return [lrs[step] for step in steps]


def test_a_resume_follows_the_schedule_its_config_describes(extended_resume, baseline_run):
    """Extending a run (6 -> 12 steps, a higher LR) on --resume: megatron's scheduler kept the checkpoint's
    decay steps and peak LR, so the new steps all ran at min_lr while config.yaml said otherwise."""
    out, stdout = extended_resume
    trained = step_metric(out, "lr")[4:]
    expected = _fresh_schedule_lrs(out / "config.yaml", range(5, 9))
    old_schedule = _fresh_schedule_lrs(baseline_run / "config.yaml", range(5, 9))
    print(f"LR at steps 5-8 of a run extended from 4 to 8 steps at lr 2e-3: {[f'{x:.3e}' for x in trained]}; "
          f"a fresh 8-step run: {[f'{x:.3e}' for x in expected]}; the checkpoint's schedule: "
          f"{[f'{x:.3e}' for x in old_schedule]}")
    assert trained == pytest.approx(expected, rel=1e-12) and trained != pytest.approx(old_schedule)
    assert ("LR schedule from this run's config, changed since the checkpoint: optimizer.lr 0.001 -> 0.002, "
            "training.train_steps 4 -> 8") in stdout, stdout


def test_a_resume_in_a_new_data_order_starts_the_data_afresh_when_asked(extended_resume):
    out, stdout = extended_resume
    assert "data.accept_new_order=true: the data order changed since" in stdout
    assert "(data.seed 1234 -> 7); the data starts afresh at epoch 0" in stdout, stdout
    rank_state = torch.load(out / "checkpoints" / step_dir_name(6) / "rank_00000.pt", weights_only=False)
    assert rank_state["data_state"]["order"]["data.seed"] == 7


def test_a_resume_in_another_data_order_stops_in_one_line(baseline_run, tmp_path):
    """The saved position indexes data.seed's permutation: tests/data/test_pipeline.py counts what a
    resume in another order would train twice and never."""
    cut_back_copy(baseline_run, tmp_path / "run", 2)
    proc = run_train(tmp_path / "run", "data.seed=7", resume=True, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if "data.seed" in line]
    assert "was trained with data.seed=1234 and this run has data.seed=7" in line
    assert "set data.seed=1234 to resume, or data.accept_new_order=true" in line


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    proc = run_train(tmp_path, resume=True, expect_ok=False)
    assert proc.returncode != 0
    assert "no complete checkpoint" in proc.stderr


def test_real_demo_conversations_train_and_bad_samples_are_counted(tmp_path):
    from tests.shared_data import SHARED_DATA

    demo = SHARED_DATA / "llamafactory"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
        '{"messages": [{"role": "user", "content": "<image>what?"}, '
        '{"role": "assistant", "content": "x"}], "images": ["missing.jpg"]}\n'
        '{not json\n')
    out = tmp_path / "run"
    paths = f"[{demo / 'mllm_demo.json'},{demo / 'mllm_video_demo.json'},{broken}]"
    proc = run_train(out, "data.source=files", f"data.paths={paths}", "data.seq_len=2048",
                     "data.video_max_frames=4", "training.train_steps=2", f"data.cache_dir={tmp_path / 'cache'}")
    # The start-up lines say where the Arrow cache is, what it holds and the room left (issue 30).
    assert re.search(rf"^cache: {tmp_path / 'cache'}, 3 Arrow copies \([\d.]+ KB\), [\d.]+ [KMGT]?B free$",
                     proc.stdout + proc.stderr, re.MULTILINE), proc.stdout[-3000:]
    assert all(math.isfinite(v) for v in losses(out))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["line"], r["reason"]) for r in rejects} == {(2, "missing_image"), (3, "malformed_json")}
    assert all(r["file"] == str(broken) for r in rejects)
    assert "2 samples rejected" in proc.stdout + proc.stderr


def test_two_ranks_train_on_demo_data_where_most_samples_are_too_long(tmp_path):
    # 4 of the 6 demo conversations exceed 200 tokens (186, 144, 215, 253, 214 and 360 with the small
    # vocabulary); each rank reads every second position
    # (data.read=sharded), so reject runs longer than the data set are normal, not "all rejected".
    from tests.shared_data import SHARED_DATA

    demo = SHARED_DATA / "llamafactory" / "mllm_demo.json"
    proc = run_train(tmp_path, "data.source=files", f"data.paths=[{demo}]", "data.seq_len=200",
                     "data.max_pixels=50176", "training.train_steps=2", nproc=2)
    assert len(losses(tmp_path)) == 2 and all(math.isfinite(v) for v in losses(tmp_path))
    rejects = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == ["too_long"] * 4
    assert "4 samples rejected (too_long: 4)" in proc.stdout + proc.stderr


def test_only_rejected_samples_is_a_one_line_error(tmp_path):
    from tests.shared_data import SHARED_DATA

    demo = SHARED_DATA / "llamafactory" / "mllm_demo.json"
    proc = run_train(tmp_path, "data.source=files", f"data.paths=[{demo}]", "data.seq_len=16",
                     "training.train_steps=1", expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: all 6 samples were rejected (too_long: 6); see {tmp_path / 'rejects.jsonl'}")
    assert "Traceback" not in proc.stderr


def test_a_mixture_entry_whose_every_sample_is_rejected_stops_before_step_1(tmp_path):
    """Issue 49: its weight went to the other entries, silently. Now exit 2, one line naming it."""
    from tests.shared_data import SHARED_DATA

    demo = SHARED_DATA / "llamafactory" / "mllm_demo.json"
    gone = tmp_path / "images_gone.jsonl"
    record = {"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}]}
    gone.write_text("".join(json.dumps({**record, "images": [f"gone/{i}.jpg"]}) + "\n" for i in range(4)))
    proc = run_train(tmp_path / "run", "data.source=files", f"data.paths=[{demo}@1,{gone}@1]",
                     "training.train_steps=1", f"data.cache_dir={tmp_path / 'cache'}", expect_ok=False)
    print(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: data.paths entry {str(gone)!r}: all 4 samples were rejected (missing_image: 4); fix them or drop "
        "the entry (its weight would go to the other entries)")
    assert "Traceback" not in proc.stderr and "step 1" not in proc.stdout


def test_rejects_reported_are_those_of_the_trained_steps_at_every_layout(tmp_path):
    """Issue 49: the summary counted the rejects the prefetching reader had reached (16,858 once,
    20,011 the next time; rejects.jsonl 20,011 both times). It now counts, and rejects.jsonl lists,
    those met making the steps trained: the same without prefetching at one rank as prefetching at
    DP 2."""
    good = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]})
    data = tmp_path / "every_third_malformed.jsonl"
    data.write_text("".join(('{"messages": [\n' if line % 3 == 0 else good + "\n") for line in range(1, 301)))
    common = ("data.source=files", f"data.paths=[{data}]", "data.seq_len=64", "data.shuffle=false",
              "data.read=global", "training.train_steps=2", f"data.cache_dir={tmp_path / 'cache'}")
    figures = {}
    for name, nproc, workers in (("1 rank, no prefetch", 1, 0), ("DP 2, prefetching", 2, 1)):
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        run_train(out, *common, f"data.num_workers={workers}", nproc=nproc, preset="llm-tiny-small-vocab")
        listed = {(r["line"], r["reason"]) for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
        figures[name] = (sum(json.loads((out / "summary.json").read_text())["rejects"].values()), len(listed))
    print(f"rejects after 2 steps (summary.json, rejects.jsonl): {figures}")
    assert len(set(figures.values())) == 1 and len(set(figures["1 rank, no prefetch"])) == 1
