"""Option and argument types shared by every loongforge command.

Commands declare parameters with these ``Annotated`` aliases so that an option is spelled, typed
and explained the same way everywhere (``--preset`` in ``train`` means what it will mean in
``pack`` or ``bench``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from loongforge.config.presets import DEFAULT_PRESET


def inputs_argument(help: str) -> Any:
    """``INPUT...``: the data files or folders a command reads (``help``: which it takes)."""
    return Annotated[list[Path], typer.Argument(metavar="INPUT...", show_default=False, help=help)]


def output_folder_option(contents: str) -> Any:
    """``--output/-o DIR``: the folder a command writes (``contents``: what it puts there)."""
    return Annotated[Path, typer.Option("--output", "-o", metavar="DIR", show_default=False,
                                        help=f"Folder to write: {contents}.")]


def flag_option(name: str, help: str) -> Any:
    """A boolean ``--name`` flag."""
    return Annotated[bool, typer.Option(name, help=help)]


def optional_option(kind: Any, name: str, metavar: str, help: str, **limits: Any) -> Any:
    """A ``--name VALUE`` option that is unset (None, no default shown) unless given; ``limits``: typer's
    ``min`` / ``max``."""
    return Annotated[Optional[kind], typer.Option(name, metavar=metavar, show_default=False, help=help, **limits)]


def set_option(help: str) -> Any:
    """``--set KEY=VALUE`` (repeatable): config overrides of a command that takes no positional ones."""
    return Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", show_default=False, help=help)]


def progress_option(help: str) -> Any:
    """``--progress/--no-progress``: a tqdm bar (``help``: what it counts)."""
    return Annotated[bool, typer.Option("--progress/--no-progress", help=help)]


PresetOption = Annotated[Optional[str], typer.Option(
    "--preset", "-p", metavar="NAME", show_default=False,
    help=f"Preset to start from (see --list-presets). Default: {DEFAULT_PRESET}.")]

ConfigFileOption = Annotated[Optional[Path], typer.Option(
    "--config", "-c", metavar="FILE.yaml", show_default=False,
    help="YAML file merged on top of the preset (same keys as --dry-run prints).")]

OverridesArgument = Annotated[Optional[list[str]], typer.Argument(
    metavar="KEY=VALUE|~KEY", show_default=False,
    help="Dotted overrides applied last, e.g. optimizer.lr=1e-4 "
         "model.language.mrope_section=[16,24,24]; ~KEY restores the schema default.")]

ListPresetsOption = flag_option(
    "--list-presets", "List the presets with their size, layout and sequence length, then exit.")

ShowPresetOption = Annotated[Optional[str], typer.Option(
    "--show-preset", metavar="NAME", show_default=False,
    help="Print a preset composed from its component files as YAML, then exit.")]

DryRunOption = flag_option(
    "--dry-run", "Resolve and validate the config, print it with the parallel plan, then exit.")

SuggestLayoutOption = flag_option(
    "--suggest-layout", "With --dry-run: the pipeline layouts (PP, virtual stages, layers per stage) with the "
    "smallest predicted step at this world size, and the overrides to run the best.")
FitSeqLenOption = Annotated[Optional[int], typer.Option(
    "--fit-seq-len", min=1, metavar="N", show_default=False,
    help="With --dry-run: plan data.seq_len=N and print the smallest context-parallel size whose memory "
         "per rank fits the GPU, with the overrides to run it.")]

GpuMemoryOption = Annotated[float, typer.Option(
    "--gpu-memory-gib", min=1, metavar="GIB",
    help="With --dry-run: memory of one GPU, of which a plan may fill 90%.")]

NprocPerNodeOption = Annotated[Optional[int], typer.Option(
    "--nproc-per-node", min=1, metavar="N", show_default=False,
    help="Processes to start on this node (torch elastic launcher); ignored under torchrun/SLURM. "
         "Default: parallel.world_size for --dry-run; else one process, so parallel.world_size must be 1.")]

ResumeOption = flag_option("--resume", "Continue from the latest checkpoint in the run's checkpoint folder.")

OutputDirOption = Annotated[Optional[Path], typer.Option(
    "--output-dir", "-o", metavar="DIR", show_default=False,
    help="Run folder for logs, resolved config and checkpoints (sets logging.output_dir).")]

VerboseOption = flag_option(
    "--verbose", "Also show the known harmless third-party warnings, once each (logging.verbose=true).")
OverwriteOption = flag_option(
    "--overwrite", "Start fresh in a run folder that holds an earlier run: move that run aside to "
    "<folder>.old-<time> first (nothing is deleted).")

