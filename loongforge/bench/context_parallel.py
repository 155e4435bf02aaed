"""``loongforge bench context-parallel``: what ``parallel.encoder_cp`` saves, measured in real training.

For each layout (CP 2: 2 processes; CP 4: 4; TP 1, DP 1) and each mode, one ``loongforge train`` run
of the shared grid (``bench.train_grid``: the encoder-heavy preset on rows of many COCO photos,
per-rank encoder time, step time and peak memory read from ``metrics.jsonl``). ``off``: every CP rank
encodes all of the row's photos; ``on``: each encodes a cost-chosen share and the features are
gathered (``models.vlm.encoder_share``). Ratios are against ``off`` in the same layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from loongforge.bench.train_grid import BenchSettings, GridBench, Layout, TrainGrid, run_grid

MODES = ("off", "on")  # the baseline first
CONTEXT_PARALLEL = {"cp2": 2, "cp4": 4}
DEFAULT_LAYOUTS = tuple(CONTEXT_PARALLEL)
# Every sample padded to a multiple of 2 x the largest CP in both layouts, so that CP 2 and CP 4
# train on the same rows (null would pad to 2 x each run's own CP).
SAMPLE_MULTIPLE = 2 * max(CONTEXT_PARALLEL.values())
# Two 4-photo chats (~1,050 tokens each at 448 x 448) fill a 2304-token row: eight photos to a row,
# at least two for each CP 4 rank to encode; one row per step.
DEFAULT_SETTINGS = BenchSettings(images_per_sample=4, seq_len=2304, micro_batches=1)


def _layout(context_parallel: int) -> Layout:
    return Layout(f"CP{context_parallel}", context_parallel, (
        f"parallel.world_size={context_parallel}", f"parallel.context_parallel_size={context_parallel}",
        "parallel.tensor_model_parallel_size=1", "parallel.encoder_dp=none",
        f"data.sample_multiple={SAMPLE_MULTIPLE}"))


def _mode_overrides(mode: str) -> list[str]:
    return [f"parallel.encoder_cp={'true' if mode == 'on' else 'false'}"]


LAYOUTS = {name: _layout(size) for name, size in CONTEXT_PARALLEL.items()}
GRID = TrainGrid(option="encoder_cp", baseline="off", layouts=LAYOUTS, mode_overrides=_mode_overrides)


def run_context_parallel_bench(out: Path, data_root: Optional[Path], *, layouts: Sequence[str] = DEFAULT_LAYOUTS,
                               settings: BenchSettings = DEFAULT_SETTINGS, report_only: bool = False,
                               command_line: Sequence[str] = (),
                               progress: Optional[Callable[[str], None]] = None) -> GridBench:
    """Train (or, with ``report_only``, reread) encoder_cp off and on in every layout under ``out``;
    write context_parallel.md, context_parallel.json and context_parallel.png there."""
    return run_grid(GRID, "context_parallel", out, data_root, modes=MODES, layouts=layouts, settings=settings,
                    report_only=report_only, command_line=command_line, progress=progress)
