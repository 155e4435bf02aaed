"""Test-only: run `loongforge train` as one rank of an externally launched job and record, per
consumed step, what the data pipeline handed this rank: the balancing plan (``last_balance``) and
the sample ids of each of its micro-batches.

    python -m tests.train.plan_recorder RECORD.jsonl train --preset ... (RANK/WORLD_SIZE set)

The CLI runs the worker in this process when RANK and WORLD_SIZE are set (as under torchrun), so a
wrapper on ``DataPipeline.next_step`` installed here sees every step; nothing in the library
changes. Lines are appended: a resumed run continues the interrupted run's record.
"""

from __future__ import annotations

import json
import sys


def install(record_path: str) -> None:
    from loongforge.data.pipeline import DataPipeline

    next_step = DataPipeline.next_step

    def recording_next_step(self):
        micro_batches = next_step(self)
        decision = self.last_balance
        record = {
            "step": self.state_dict()["step"],  # the consumed position: steps so far
            "sample_ids": [list(mb["sample_ids"]) for mb in micro_batches],
            "plan": None if decision is None else decision.micro_batches,
            "applied": None if decision is None else decision.applied,
        }
        with open(record_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return micro_batches

    DataPipeline.next_step = recording_next_step


if __name__ == "__main__":
    install(sys.argv[1])
    from loongforge.cli.app import app

    app(args=sys.argv[2:], prog_name="loongforge")
