"""Test-only: run `loongforge train` as one rank of an externally launched job and record, per
consumed step, what the data pipeline handed this rank: the balancing plan (``last_balance``) and
the sample ids of each of its micro-batches, and the stream positions (epoch, position) of its rows'
samples.

    python -m tests.train.plan_recorder RECORD.jsonl train --preset ... (RANK/WORLD_SIZE set)

The CLI runs the worker in this process when RANK and WORLD_SIZE are set (as under torchrun), so a
wrapper on ``DataPipeline.next_step`` installed here sees every step; nothing in the library
changes. Lines are appended: a resumed run continues the interrupted run's record.
"""

from __future__ import annotations

import json
import sys


class _Step(list):
    """A step's micro-batches, carrying the stream positions of its rows from the data thread."""

    keys = None


def _record_stream_keys() -> None:
    """Each produced step carries the (epoch, position) of its rows' samples (``keys``: one list
    per row, in row order; with sharded reading and no balancing, one per micro-batch)."""
    from loongforge.data.pipeline import DataPipeline, RowStream
    from loongforge.data.streaming import StreamingRowStream

    for stream_class in (RowStream, StreamingRowStream):
        def recording_next_row(self, next_row=stream_class.next_row):
            row = next_row(self)
            if getattr(self, "recorded_keys", None) is not None:
                self.recorded_keys.append([list(item.key) for item in row])
            return row

        stream_class.next_row = recording_next_row
    produce_step = DataPipeline._produce_step

    def recording_produce_step(self):
        if self.stream is not None:
            self.stream.recorded_keys = []
        produced = produce_step(self)
        step = _Step(produced.micro_batches)
        step.keys = self.stream.recorded_keys if self.stream is not None else None
        return produced._replace(micro_batches=step)

    DataPipeline._produce_step = recording_produce_step


def install(record_path: str, batches_dir: str | None = None) -> None:
    """Record every step to ``record_path``; with ``batches_dir``, also the step's micro-batches as the
    model got them (``step<N>.pt``, N from 1: a reference model can train on exactly those)."""
    from loongforge.data.pipeline import DataPipeline

    _record_stream_keys()
    next_step = DataPipeline.next_step

    def recording_next_step(self):
        micro_batches = next_step(self)
        decision = self.last_balance
        record = {
            "step": self.state_dict()["step"],  # the consumed position: steps so far
            "sample_ids": [list(mb["sample_ids"]) for mb in micro_batches],
            "keys": getattr(micro_batches, "keys", None),
            "plan": None if decision is None else decision.micro_batches,
            "applied": None if decision is None else decision.applied,
        }
        with open(record_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if batches_dir is not None:
            import torch

            torch.save(list(micro_batches), f"{batches_dir}/step{record['step']}.pt")
        return micro_batches

    DataPipeline.next_step = recording_next_step


if __name__ == "__main__":
    install(sys.argv[1])
    from loongforge.cli.app import app

    app(args=sys.argv[2:], prog_name="loongforge")
