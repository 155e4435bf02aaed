"""``loongforge train``: resolve a run config, then dry-run it or train with it."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from loongforge.cli.errors import cli_errors
from loongforge.cli.options import (
    ConfigFileOption, DryRunOption, ListPresetsOption, NprocPerNodeOption, OutputDirOption,
    OverridesArgument, PresetOption, ResumeOption, ShowPresetOption)
from loongforge.config.loader import dump_yaml, load_run_config
from loongforge.config.overrides import Override
from loongforge.config.presets import DEFAULT_PRESET
from loongforge.config.schema import RunConfig
from loongforge.parallel import launcher


def _output_dir_override(output_dir: Path | None) -> list[Override]:
    # Built directly rather than as text so a path is never reparsed as YAML.
    if output_dir is None:
        return []
    return [Override("--output-dir", ("logging", "output_dir"), delete=False,
                     value=str(output_dir))]


def _launch_world_size(nproc_per_node: int | None, dry_run: bool) -> int | None:
    """World size to validate against; None lets a dry run use parallel.world_size.

    A real run without a launcher or --nproc-per-node is one process, whatever the preset's
    world_size says, so it is validated as such.
    """
    world_size = launcher.resolve_world_size(nproc_per_node)
    return world_size if world_size is not None or dry_run else 1


def _print_dry_run(cfg: RunConfig) -> None:
    from loongforge.cli.plan import build_parallel_plan, format_parallel_plan

    typer.echo("# resolved config")
    typer.echo(dump_yaml(cfg))
    typer.echo(format_parallel_plan(build_parallel_plan(cfg)))


def train(
    overrides: OverridesArgument = None,
    preset: PresetOption = None,
    config: ConfigFileOption = None,
    list_presets: ListPresetsOption = False,
    show_preset: ShowPresetOption = None,
    dry_run: DryRunOption = False,
    nproc_per_node: NprocPerNodeOption = None,
    resume: ResumeOption = False,
    output_dir: OutputDirOption = None,
) -> None:
    """Train a vision-language model from a preset, a YAML file and key=value overrides."""
    with cli_errors():
        if list_presets or show_preset:
            from loongforge.cli.presets_view import format_composed_preset, format_presets_table

            text = format_presets_table() if list_presets else format_composed_preset(show_preset)
            typer.echo(text)
            return
        cfg = load_run_config(
            preset or DEFAULT_PRESET,
            config_file=config,
            overrides=[*(overrides or []), *_output_dir_override(output_dir)],
            world_size=_launch_world_size(nproc_per_node, dry_run),
        )
        if dry_run:
            _print_dry_run(cfg)
            return
        launcher.run(cfg, nproc_per_node=nproc_per_node, resume=resume, command_line=list(sys.argv))
