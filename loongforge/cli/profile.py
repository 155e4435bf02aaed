"""``loongforge profile``: time every rank's micro-batches during real training steps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import UsageError, cli_errors
from loongforge.cli.options import ConfigFileOption, NprocPerNodeOption, PresetOption
from loongforge.config.presets import DEFAULT_PRESET

InputsArgument = Annotated[Optional[list[str]], typer.Argument(
    metavar="[DATA...] [KEY=VALUE...]", show_default=False,
    help="Dataset files or folders (as for data.paths) and dotted overrides (KEY=VALUE, ~KEY).")]


def split_inputs(inputs: list[str]) -> tuple[list[str], list[str]]:
    """(data paths, overrides): an override contains '=' or starts with '~'."""
    overrides = [item for item in inputs if "=" in item or item.startswith("~")]
    return [item for item in inputs if item not in overrides], overrides


def profile(
    inputs: InputsArgument = None,
    output: Annotated[Path, typer.Option(
        "--output", metavar="PROFILE.jsonl",
        help="Where to write the records (one per rank per micro-batch, per step, and the environment).")] = Path("PROFILE.jsonl"),
    preset: PresetOption = None,
    config: ConfigFileOption = None,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, metavar="N", help="Training steps to run and record.")] = 20,
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, metavar="N",
        help="First steps recorded but flagged warmup (left out of fits by default).")] = 2,
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Train on a designed grid of lengths and image sizes instead of the data, "
                        "so every cost term can be fitted.")] = False,
    answer_share: Annotated[float, typer.Option(
        "--answer-share", min=0.01, max=1.0, metavar="FRACTION",
        help="With --sweep: share of each sample's tokens that carry loss. The LM head runs on "
             "those only; match your data's share (fit-cost prints it).")] = 0.25,
    nproc_per_node: NprocPerNodeOption = None,
) -> None:
    """Run real training steps and record each rank's per-micro-batch compute time and features."""
    from loongforge.calibrate.profile_run import profile_overrides, run_profile
    from loongforge.config.loader import load_run_config
    from loongforge.parallel import launch_env

    with cli_errors():
        data, overrides = split_inputs(inputs or [])
        if sweep and data:
            raise UsageError(f"--sweep replaces the dataset; drop {data[0]} or --sweep")
        if warmup_steps >= steps:
            raise UsageError(f"--warmup-steps {warmup_steps} leaves no step to fit from "
                             f"--steps {steps}; raise --steps")
        output = output.resolve()
        cfg = load_run_config(preset or DEFAULT_PRESET, config_file=config,
                              overrides=[*overrides, *profile_overrides(data, output, steps)],
                              world_size=launch_env.resolve_world_size(nproc_per_node) or 1)
        run_profile(cfg, output, nproc_per_node=nproc_per_node, sweep=sweep, warmup_steps=warmup_steps,
                    command_line=list(sys.argv), answer_share=answer_share)
        typer.echo(f"wrote {output}")
