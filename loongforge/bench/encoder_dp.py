"""``loongforge bench encoder-dp``: what ``parallel.encoder_dp`` saves, measured in real training.

For each layout (TP2: 2 processes; TP2 x PP2: 4) and each mode, one ``loongforge train`` run of the
shared grid (``bench.train_grid``: the encoder-heavy preset on COCO photo chats, per-rank encoder
time, step time and peak memory read from ``metrics.jsonl``). Every mode runs at vision TP 1 (a whole
encoder on each rank): ``none`` encodes every image on every rank of a TP group, ``tp`` divides them,
``full`` divides a step's images over TP x PP. Ratios are against ``none`` in the same layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from loongforge.bench.train_grid import BenchSettings, GridBench, Layout, TrainGrid, run_grid
from loongforge.config.errors import InputError
from loongforge.config.validate import CHOICES

DEFAULT_MODES = ("none", "tp")
DEFAULT_LAYOUTS = ("tp2", "tp2pp2")
# Two 2-image chats (~500 tokens each at 448 x 448) fill a 1152-token row: four images per micro-batch;
# two micro-batches per step, so that PP 2 runs a real 1F1B schedule.
DEFAULT_SETTINGS = BenchSettings(images_per_sample=2, seq_len=1152, micro_batches=2)


def _layout(tensor_parallel: int, pipeline_parallel: int) -> Layout:
    name = f"TP{tensor_parallel}" + (f" x PP{pipeline_parallel}" if pipeline_parallel > 1 else "")
    processes = tensor_parallel * pipeline_parallel
    return Layout(name, processes, (f"parallel.world_size={processes}",
                                    f"parallel.tensor_model_parallel_size={tensor_parallel}",
                                    f"parallel.pipeline_model_parallel_size={pipeline_parallel}",
                                    "parallel.vision_tensor_model_parallel_size=1"))


def _mode_overrides(mode: str) -> list[str]:
    return [f"parallel.encoder_dp={mode}"]


LAYOUTS = {"tp2": _layout(2, 1), "tp2pp2": _layout(2, 2)}
GRID = TrainGrid(option="encoder_dp", baseline="none", layouts=LAYOUTS, mode_overrides=_mode_overrides)


def valid_modes(modes: Sequence[str]) -> list[str]:
    """``modes`` if the config validator accepts each (``none`` first, the baseline); else InputError."""
    accepted = CHOICES["parallel.encoder_dp"]
    unknown = [mode for mode in modes if mode not in accepted]
    if unknown or not modes:
        raise InputError(f"--modes {','.join(modes)}: expected some of {' | '.join(accepted)}")
    return ["none", *(mode for mode in modes if mode != "none")]


def run_encoder_dp_bench(out: Path, data_root: Optional[Path], *, modes: Sequence[str] = DEFAULT_MODES,
                         layouts: Sequence[str] = DEFAULT_LAYOUTS, settings: BenchSettings = DEFAULT_SETTINGS,
                         report_only: bool = False, command_line: Sequence[str] = (),
                         progress: Optional[Callable[[str], None]] = None) -> GridBench:
    """Train (or, with ``report_only``, reread) every (layout, mode) run under ``out``; write
    encoder_dp.md, encoder_dp.json and encoder_dp.png there."""
    return run_grid(GRID, "encoder_dp", out, data_root, modes=valid_modes(modes), layouts=layouts,
                    settings=settings, report_only=report_only, command_line=command_line, progress=progress)
