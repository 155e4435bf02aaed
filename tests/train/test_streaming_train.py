"""data.streaming=true through the command line: a run stopped at step 2 and resumed trains on the
same samples as an uninterrupted one (bit-identical losses and checkpoint), across windows and an
epoch boundary of real demo conversations with images; resumed on a changed data file it refuses
in one line naming the file, and with data.accept_changed_files=true it continues."""

from __future__ import annotations

import re

import pytest

from tests.data.conftest import LLAMAFACTORY, require
from tests.train.conftest import (
    SAVE_AT_END,
    checkpoint_differences,
    cut_back_copy,
    losses,
    resume_from_copy,
    run_train,
)

DEMO_JSONL = LLAMAFACTORY / "v1_multimodal_demo.jsonl"
STREAMING = (
    f"data.paths=[{require(LLAMAFACTORY / 'mllm_demo.json')},{require(DEMO_JSONL)}]",
    "data.source=files", "data.streaming=true", "data.shuffle_window=8", "training.train_steps=5",
    "checkpoint.save_interval=2", SAVE_AT_END,
)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted streaming run, checkpoints at steps 2, 4 and 5."""
    out = tmp_path_factory.mktemp("streaming") / "whole"
    run_train(out, *STREAMING)
    return out


def test_streaming_run_stopped_and_resumed_trains_on_the_same_samples(whole, tmp_path):
    resumed = tmp_path / "resumed"
    resume_from_copy(whole, resumed, 2, *STREAMING)
    print(f"\nlosses, uninterrupted: {losses(whole)}\nlosses, resumed at 2:  {losses(resumed)}")
    assert len(losses(whole)) == 5 and losses(resumed) == losses(whole)
    assert max(checkpoint_differences(resumed, whole).values()) == 0.0


def test_a_changed_data_file_refuses_the_resume_unless_accepted(whole, tmp_path):
    # The same files elsewhere (a moved file with the same bytes would resume as before), the JSON
    # lines without their first record: every byte offset the checkpoint holds now points elsewhere.
    data = tmp_path / "data"
    data.mkdir()
    (data / "mllm_demo_data").symlink_to(LLAMAFACTORY / "mllm_demo_data")
    (data / "mllm_demo.json").write_bytes((LLAMAFACTORY / "mllm_demo.json").read_bytes())
    lines = DEMO_JSONL.read_bytes().splitlines(keepends=True)
    changed = data / DEMO_JSONL.name
    changed.write_bytes(b"".join(lines[1:]))
    paths = f"data.paths=[{data / 'mllm_demo.json'},{changed}]"
    copy = cut_back_copy(whole, tmp_path / "resumed", 2)

    refused = run_train(copy, *STREAMING, paths, resume=True, expect_ok=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    print(f"\n{line}")
    assert line == (f"error: data file {changed} (recorded as {DEMO_JSONL}) changed since the checkpoint (size "
                    f"{DEMO_JSONL.stat().st_size} -> {changed.stat().st_size} bytes): the checkpoint's data "
                    "position (byte offsets, sample indices) no longer names the same samples; restore the file, "
                    "or set data.accept_changed_files=true to continue from the recorded sample count in the "
                    "changed data")
    assert losses(copy) == losses(whole)[:2]  # the refused resume left the run folder as it was

    accepted = run_train(copy, *STREAMING, paths, "data.accept_changed_files=true", resume=True)
    (warning,) = [line for line in (accepted.stdout + accepted.stderr).splitlines() if line.startswith("warning: data")]
    print(warning)
    assert warning.startswith(f"warning: data file {changed} (recorded as {DEMO_JSONL}) changed since the checkpoint")
    assert re.search(r"; data.accept_changed_files=true: continuing at epoch \d+, sample \d+ of the changed data$", warning)
    print(f"losses, uninterrupted:               {losses(whole)}\nlosses, resumed on the changed file: {losses(copy)}")
    assert losses(copy)[:2] == losses(whole)[:2] and len(losses(copy)) == 5
