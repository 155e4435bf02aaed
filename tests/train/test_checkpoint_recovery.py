"""Checkpoints on real clusters: a full disk while saving, damaged files when resuming.

A full disk is a real tmpfs (``mount -t tmpfs``); the tests that need one skip where mounting is
not allowed (not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loongforge.config.errors import InputError
from loongforge.train import checkpoint
from loongforge.train.checkpoint import (
    DamagedCheckpoint,
    TrainState,
    check_checkpoint_files,
    load_newest_checkpoint,
    save_checkpoint,
)
from tests.train.conftest import SAVE_AT_END, losses, run_train


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB file system of its own (the small-vocabulary model's checkpoint needs ~14 MiB),
    unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def _fill_then_fail_like_torch(tmp_dir, *args) -> None:
    """What dist_checkpointing does on a full disk: write until ENOSPC, then report torch's zip
    writer error, which has lost the errno."""
    chunk = bytes(2**20)
    try:
        with open(tmp_dir / "model_optim" / "__0_0.distcp", "wb") as f:
            while True:
                f.write(chunk)
                f.flush()
    except OSError:
        raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . "
                           "unexpected pos 704 vs 598") from None


def test_disk_full_during_save_names_the_cause_and_removes_the_partial_folder(small_disk, monkeypatch):
    monkeypatch.setattr(checkpoint, "_write_shards", _fill_then_fail_like_torch)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: the space check before writing passes
    state = TrainState(step=3, consumed_rows=0, data_state={}, extra={})
    with pytest.raises(InputError) as error:
        save_checkpoint(small_disk / "ckpt", state, [model], None, None, layout={})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"cannot save checkpoint {small_disk / 'ckpt' / 'step_00000003'}: "
                              "no space left on device (this rank's share needs about 4 MiB, 0 MiB free)")
    assert list((small_disk / "ckpt").iterdir()) == []  # no step_00000003.tmp filling the disk


def test_training_onto_a_full_disk_is_one_line_and_clears_stale_partial_saves(small_disk, tmp_path):
    stale = small_disk / "ckpt" / "step_00000009.tmp"  # a run killed mid-save left this behind
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(bytes(2**20))
    proc = run_train(tmp_path / "run", f"checkpoint.dir={small_disk / 'ckpt'}", "training.train_steps=1",
                     SAVE_AT_END, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot save a checkpoint under {small_disk / 'ckpt'}: no space left on "
                           "device (this rank's share needs about "), last
    assert "Traceback" not in proc.stderr
    assert list((small_disk / "ckpt").iterdir()) == []


def test_resume_skips_a_truncated_newest_checkpoint(baseline_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline_run, run)  # checkpoints at steps 2 and 4
    newest = run / "checkpoints" / "step_00000004"
    shard = max((newest / "model_optim").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:  # a copy or a node that died halfway
        f.truncate(shard.stat().st_size // 2)
    proc = run_train(run, "checkpoint.save_interval=2", resume=True)
    output = proc.stdout + proc.stderr
    assert f"warning: skipped a damaged checkpoint: {shard}: truncated" in output
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in output
    # Steps 3 and 4 once each: re-run after the skip, as the baseline ran them.
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert losses(run) == losses(baseline_run)


def _tiny_checkpoint(path: Path) -> Path:
    """A checkpoint folder with real torch_dist files but no model behind them."""
    dcp.save({"weight": torch.ones(64)}, checkpoint_id=str(path / "model_optim"), no_dist=True)
    torch.save({}, path / "model_optim" / "common.pt")
    torch.save({"step": 1}, path / "rank_00000.pt")
    (path / "meta.json").write_text(json.dumps({"step": 1}))
    return path


def test_an_empty_common_file_is_named(tmp_path):
    folder = _tiny_checkpoint(tmp_path / "step_00000001")
    check_checkpoint_files(folder)  # intact
    (folder / "model_optim" / "common.pt").write_bytes(b"")
    with pytest.raises(DamagedCheckpoint, match=rf"^{folder / 'model_optim' / 'common.pt'}: unreadable"):
        check_checkpoint_files(folder)


def test_no_loadable_checkpoint_is_one_line_naming_each(tmp_path):
    older = _tiny_checkpoint(tmp_path / "step_00000001")
    newer = _tiny_checkpoint(tmp_path / "step_00000002")
    (older / "rank_00000.pt").write_bytes(b"\x80\x02")  # a pickle cut short
    shard = next((newer / "model_optim").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(InputError) as error:
        load_newest_checkpoint(tmp_path, [torch.nn.Linear(2, 2)], None, None)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--resume: no checkpoint under {tmp_path} loads (")
    assert message.index(str(shard)) < message.index(str(older / "rank_00000.pt"))  # newest first
