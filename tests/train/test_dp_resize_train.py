"""A sharded read (data.read=sharded) resumed at another data-parallel size trains every sample of
the epoch exactly once across the restarts (issue 30). Indexed: DP 2 for steps 1-2, a cut-back copy
resumed at DP 4 for steps 3-4, a cut-back copy of that resumed at DP 2 for steps 5-8. Streamed
(data.streaming=true): DP 2 for steps 1-2, resumed at DP 4 for steps 3-4. Each rank records the
sample ids and stream positions of what it trained (tests.train.plan_recorder).

The indexed runs train with what DP > 1 gets by default (issue 54): the distributed optimizer (Adam's
moments and the fp32 weights sharded over the DP ranks, saved resharded) with overlapped grad reduce,
and the opt-in overlapped param gather besides. The same DP 2 -> 4 chain with all three off (the plain
optimizer, whose state every rank holds whole) trains the same steps 1-4 to fp32 rounding: so the
default changes no math, the sharded state saved at DP 2 is restored at DP 4 exactly where it belongs
(a misplaced moment would change the updates of steps 3 and 4), and a save under the param gather holds
the updated weights (without train.checkpoint's gather they differed by 4.6e-3)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from loongforge.convert.checkpoint_folders import step_dir_name
from tests.data.conftest import write_conversations
from tests.train.conftest import (
    SAVE_AT_END,
    assert_close_relative,
    checkpoint_differences,
    cut_back_copy,
    grad_norms,
    losses,
    run_recorded,
)

PRESET = "llm-tiny-small-vocab"  # text only: the data path is the VLM's, the steps are cheaper
SAMPLES = 60
STREAMED_SAMPLES = 120  # shorter samples than the synthetic ones: about twice as many a step
# Read sharded and unprefetched (the recorder's positions are those of the rows made).
OPTIONS = ("data.read=sharded", "data.num_workers=0", "checkpoint.save_interval=2", SAVE_AT_END)
INDEXED = (f"data.synthetic_num_samples={SAMPLES}", "parallel.overlap_param_gather=true")
# The distributed optimizer and the overlapped reduce left to their default; the param gather opted in.
PLAIN_INDEXED = (INDEXED[0], "parallel.use_distributed_optimizer=false", "parallel.overlap_grad_reduce=false")
DEFAULT_DP = "data parallel: distributed optimizer, overlapped grad reduce, overlapped param gather"


def _run_recorded(out_dir: Path, *extra: str, nproc: int, resume: bool = False) -> str:
    output = run_recorded(out_dir, *OPTIONS, *extra, nproc=nproc, resume=resume, preset=PRESET)
    (out_dir / "console.txt").write_text(output)
    return output


def _resumed_copy(run: Path, out: Path, step: int, *extra: str, nproc: int) -> Path:
    """``run`` cut back to ``step`` (its records too) and resumed at ``nproc`` ranks."""
    cut_back_copy(run, out, step)
    for record in out.glob("plans_rank*.jsonl"):
        kept = [line for line in record.read_text().splitlines() if json.loads(line)["step"] <= step]
        record.write_text("".join(line + "\n" for line in kept))
    output = _run_recorded(out, *extra, nproc=nproc, resume=True)
    assert f"resumed from {out / 'checkpoints' / step_dir_name(step)} at step {step}" in output, output[-3000:]
    return out


def _trained(run: Path) -> list[tuple[int, str, int]]:
    """(step, sample id, epoch) of every sample the run's ranks trained, each rank's steps in order."""
    trained = []
    for record_file in sorted(run.glob("plans_rank*.jsonl")):
        for record in map(json.loads, record_file.read_text().splitlines()):
            for ids, keys in zip(record["sample_ids"], record["keys"], strict=True):
                trained += [(record["step"], sid, epoch) for sid, (epoch, _) in zip(ids, keys, strict=True)]
    return trained


def _streamed(data_file: Path) -> tuple[str, ...]:
    return (f"data.paths=[{data_file}]", "data.source=files", "data.streaming=true", "data.shuffle_window=16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dp_resize")
    _run_recorded(root / "dp2", *INDEXED, "training.train_steps=2", nproc=2)
    _resumed_copy(root / "dp2", root / "dp2-4", 2, *INDEXED, "training.train_steps=4", nproc=4)
    _resumed_copy(root / "dp2-4", root / "dp2-4-2", 4, *INDEXED, "training.train_steps=8", nproc=2)
    _run_recorded(root / "plain-dp2", *PLAIN_INDEXED, "training.train_steps=2", nproc=2)
    _resumed_copy(root / "plain-dp2", root / "plain-dp2-4", 2, *PLAIN_INDEXED, "training.train_steps=4", nproc=4)
    streamed = _streamed(write_conversations(root / "chats.jsonl", STREAMED_SAMPLES))
    _run_recorded(root / "streamed-dp2", *streamed, "training.train_steps=2", nproc=2)
    _resumed_copy(root / "streamed-dp2", root / "streamed-dp2-4", 2, *streamed, "training.train_steps=4", nproc=4)
    return {name: root / name for name in ("dp2-4", "dp2-4-2", "streamed-dp2-4", "plain-dp2-4")}


def _assert_epochs_once(trained: list[tuple[int, str, int]], complete: int, every: list[str], what: str) -> None:
    """The first ``complete`` epochs trained each of ``every`` sample id once; later ones none twice."""
    epochs = {e: Counter(sid for _, sid, epoch in trained if epoch == e) for e in sorted({t[2] for t in trained})}
    print(f"\n{what}: {len(trained)} samples trained over steps {sorted({t[0] for t in trained})}; " + "; ".join(
        f"epoch {e}: {sum(c.values())} trained, {len(c)} distinct of {len(every)}" for e, c in epochs.items()))
    for epoch, counts in epochs.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: {sorted(s for s, n in counts.items() if n > 1)} twice"
        if epoch < complete:
            assert sorted(counts) == sorted(every), f"epoch {epoch}"


def _saved_positions(checkpoint: Path) -> str:
    """What each shard's saved position holds (the figures behind a re-deal)."""
    states = [torch.load(f, weights_only=False)["data_state"]["stream"] for f in sorted(checkpoint.glob("rank_*.pt"))]
    return ", ".join(f"shard {s.get('shard')} at epoch {s['epoch']} cursor {s['cursor']} ({len(s['buffer'])} "
                     f"buffered, {sum(len(p) for _, p in s.get('dealt', []))} dealt)" for s in states)


SYNTHETIC_IDS = [f"synthetic:{i}" for i in range(SAMPLES)]


def test_dp2_resumed_at_dp4_trains_each_sample_once(runs):
    print(f"\nsaved at DP 2, step 2: {_saved_positions(runs['dp2-4'] / 'checkpoints' / step_dir_name(2))}")
    trained = _trained(runs["dp2-4"])
    assert {step for step, _, _ in trained} == {1, 2, 3, 4}
    _assert_epochs_once(trained, 1, SYNTHETIC_IDS, "DP 2 -> 4")


def test_dp4_resumed_at_dp2_trains_each_sample_once(runs):
    print(f"\nsaved at DP 4, step 4: {_saved_positions(runs['dp2-4-2'] / 'checkpoints' / step_dir_name(4))}")
    trained = _trained(runs["dp2-4-2"])
    assert {step for step, _, _ in trained} == set(range(1, 9))
    _assert_epochs_once(trained, 2, SYNTHETIC_IDS, "DP 2 -> 4 -> 2")


def test_streamed_dp2_resumed_at_dp4_trains_each_sample_once(runs):
    run = runs["streamed-dp2-4"]
    print(f"\nstreamed, saved at DP 2, step 2: {_saved_positions(run / 'checkpoints' / step_dir_name(2))}")
    trained = _trained(run)
    assert {step for step, _, _ in trained} == {1, 2, 3, 4}
    data_file = run.parent / "chats.jsonl"
    _assert_epochs_once(trained, 1, [f"{data_file}[{record}]" for record in range(STREAMED_SAMPLES)],
                        "streamed DP 2 -> 4")


def test_the_distributed_optimizer_is_the_default_and_trains_and_resumes_like_the_plain_one(runs):
    """DP 2 -> 4 with the defaults (distributed optimizer, overlapped reduce) and the overlapped gather against
    the same chain with all three off: losses and grad norms of steps 1-4 within 1e-6 relative, and the step-4
    checkpoint's weights and Adam moments alike."""
    sharded, plain = runs["dp2-4"], runs["plain-dp2-4"]
    assert DEFAULT_DP in (sharded / "console.txt").read_text()
    assert "data parallel: plain (all-reduce, after the backward)" in (plain / "console.txt").read_text()
    assert len(losses(sharded)) == 4
    assert_close_relative(losses(sharded), losses(plain), 1e-6, "losses, distributed optimizer vs plain")
    assert_close_relative(grad_norms(sharded), grad_norms(plain), 1e-6, "grad norms, distributed optimizer vs plain")
    differences = checkpoint_differences(sharded, plain)
    moments = {k: v for k, v in differences.items() if k.startswith("optimizer.state.exp_avg")}
    weights = {k: v for k, v in differences.items() if not k.startswith("optimizer.")}
    worst_moment, worst_weight = max(moments, key=moments.get), max(weights, key=weights.get)
    print(f"step 4 after DP 2 -> 4: Adam moments {moments[worst_moment]:.1e} ({worst_moment}), weights "
          f"{weights[worst_weight]:.1e} ({worst_weight}); worst relative difference, asserted <= 1e-5")
    assert moments[worst_moment] <= 1e-5 and weights[worst_weight] <= 1e-5
