"""data.streaming=true through the command line: a run stopped at step 2 and resumed trains on the
same samples as an uninterrupted one (bit-identical losses and checkpoint), across windows and an
epoch boundary of real demo conversations with images."""

from __future__ import annotations

from tests.data.conftest import LLAMAFACTORY, require
from tests.train.conftest import SAVE_AT_END, checkpoint_differences, losses, resume_from_copy, run_train

STREAMING = (
    f"data.paths=[{require(LLAMAFACTORY / 'mllm_demo.json')},{require(LLAMAFACTORY / 'v1_multimodal_demo.jsonl')}]",
    "data.source=files", "data.streaming=true", "data.shuffle_window=8", "training.train_steps=5",
    "checkpoint.save_interval=2", SAVE_AT_END,
)


def test_streaming_run_stopped_and_resumed_trains_on_the_same_samples(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_train(whole, *STREAMING)
    resume_from_copy(whole, resumed, 2, *STREAMING)
    print(f"\nlosses, uninterrupted: {losses(whole)}\nlosses, resumed at 2:  {losses(resumed)}")
    assert len(losses(whole)) == 5 and losses(resumed) == losses(whole)
    assert max(checkpoint_differences(resumed, whole).values()) == 0.0
