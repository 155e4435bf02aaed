"""A weighted mixture through the command line (issue 32 item 3): two data-parallel ranks reading
sharded, metrics.jsonl and summary.json count each source's samples and tokens over both ranks, a
run stopped at step 2 and resumed continues the same samples (identical losses and counts), and a
bad weight is one line, exit 2, before anything is built."""

from __future__ import annotations

import json

from tests.data.conftest import write_conversations
from tests.train.conftest import SAVE_AT_END, losses, resume_from_copy, run_train

PRESET = "llm-tiny-small-vocab"  # text only: the steps are cheap


def _sources(run) -> list[dict]:
    return [json.loads(line)["sources"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_mixture_counts_sources_and_resumes_exactly(tmp_path):
    a = write_conversations(tmp_path / "a.jsonl", 40)
    b = write_conversations(tmp_path / "b.jsonl", 80)
    options = (f"data.paths=[{a}@3,{b}@1]", "data.source=files", "data.read=sharded", "training.train_steps=4",
               "checkpoint.save_interval=2", SAVE_AT_END)
    whole = tmp_path / "whole"
    run_train(whole, *options, nproc=2, preset=PRESET)
    counts = _sources(whole)
    last = counts[-1]
    share = last[str(a)]["samples"] / (last[str(a)]["samples"] + last[str(b)]["samples"])
    print(f"\nper-source counts by step: {counts}\nshare of a after 4 steps: {share:.3f} (want 0.75)")
    assert abs(share - 0.75) <= 0.05  # a few dozen samples: within a couple of samples of 3:1
    assert all(c[str(a)]["samples"] > p[str(a)]["samples"] for p, c in zip(counts, counts[1:]))  # cumulative
    assert json.loads((whole / "summary.json").read_text())["sources"] == last

    resumed = tmp_path / "resumed"
    resume_from_copy(whole, resumed, 2, *options, nproc=2, preset=PRESET)
    print(f"losses, uninterrupted: {losses(whole)}\nlosses, resumed at 2:  {losses(resumed)}")
    assert losses(resumed) == losses(whole) and _sources(resumed) == counts

    refused = run_train(tmp_path / "bad", f"data.paths=[{a}@3,{b}]", "data.source=files", expect_ok=False,
                        preset=PRESET)
    message = [line for line in refused.stderr.splitlines() if "no weight" in line]
    print(f"exit {refused.returncode}: {message}")
    assert refused.returncode == 2 and len(message) == 1 and str(b) in message[0]


def test_streamed_mixture_logs_each_sources_epochs(tmp_path):
    """Issue 49: metrics.jsonl of a streamed weighted run logged samples and tokens, no epochs.
    Now each entry's epochs (records drawn over its records; null until read through once)."""
    a = write_conversations(tmp_path / "a.jsonl", 40)
    b = write_conversations(tmp_path / "b.jsonl", 20)
    run = tmp_path / "streamed"
    run_train(run, f"data.paths=[{a}@3,{b}@1]", "data.source=files", "data.streaming=true",
              "data.shuffle_window=16", "training.train_steps=2", preset=PRESET)
    counts = _sources(run)
    print(f"\nstreamed, per-source counts by step: {counts}")
    last = counts[-1]
    assert [last[str(p)]["epochs"] for p in (a, b)] == [round(last[str(p)]["samples"] / n, 4)
                                                         for p, n in ((a, 40), (b, 20))]
    assert last[str(a)]["epochs"] > 1 and json.loads((run / "summary.json").read_text())["sources"] == last
