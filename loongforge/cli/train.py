"""``loongforge train``: resolve a run config, then dry-run it or train with it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from loongforge.cli.errors import UsageError, cli_errors
from loongforge.cli.options import (
    ConfigFileOption,
    DryRunOption,
    FitSeqLenOption,
    GpuMemoryOption,
    ListPresetsOption,
    NprocPerNodeOption,
    OutputDirOption,
    OverridesArgument,
    OverwriteOption,
    PresetOption,
    ResumeOption,
    ShowPresetOption,
    SuggestLayoutOption,
    VerboseOption,
)
from loongforge.config.loader import dump_yaml, load_run_config, set_keys
from loongforge.config.overrides import Override
from loongforge.config.presets import DEFAULT_PRESET
from loongforge.parallel import launch_env
from loongforge.config.schema import RunConfig


def _output_dir_override(output_dir: Path | None) -> list[Override]:
    # Built directly rather than as text so a path is never reparsed as YAML.
    if output_dir is None:
        return []
    return [Override("--output-dir", ("logging", "output_dir"), delete=False,
                     value=str(output_dir))]


def _verbose_override(verbose: bool) -> list[Override]:
    return [Override("--verbose", ("logging", "verbose"), delete=False, value=True)] if verbose else []


def _with_folder_model(cfg: RunConfig, overrides: list[str], config: Path | None, *, dry_run: bool) -> RunConfig:
    """checkpoint.load_hf: the folder's config.json decides the model (``convert.hf_architecture``).
    A dry run plans a folder not downloaded yet as the preset's model, and says so."""
    if not cfg.checkpoint.load_hf:
        return cfg
    if dry_run and not (Path(cfg.checkpoint.load_hf) / "config.json").is_file():
        typer.echo(f"note: {cfg.checkpoint.load_hf}/config.json not found: planning preset {cfg.preset}'s model "
                   f"(a run reads the folder's)", err=True)
        return cfg
    from loongforge.convert.hf_architecture import model_from_hf_folder

    cfg, changes = model_from_hf_folder(cfg, cfg.checkpoint.load_hf, set_keys(overrides, config))
    if changes and _is_first_process():
        typer.echo(f"model: the architecture of {cfg.checkpoint.load_hf}/config.json, not preset "
                   f"{cfg.preset}'s: {', '.join(changes)}", err=True)
    return cfg


def _check_single_process_launch(cfg: RunConfig) -> None:
    """A run without a launcher or --nproc-per-node is one process; a larger
    parallel.world_size would silently train with one, so it is refused with the ways to start N."""
    world_size = cfg.parallel.world_size
    if world_size != 1:
        raise UsageError(f"parallel.world_size={world_size} but nothing starts {world_size} processes; "
                         f"add --nproc-per-node {world_size} (one node) or start it with torchrun/srun")


def _is_first_process() -> bool:
    # Under torchrun or SLURM every process runs this command; one of them moves folders.
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return rank == "0"


def _prepare_run(cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
    """Checks that need no process group, then (--overwrite) the earlier run moved aside."""
    from loongforge.train.preflight import check_can_start, move_previous_run_aside

    if resume and overwrite:
        raise UsageError("--resume continues the run in the folder and --overwrite moves it aside; "
                         "pass one of them")
    check_can_start(cfg, resume=resume, overwrite=overwrite)
    if overwrite and _is_first_process():
        for old, new in move_previous_run_aside(cfg):
            typer.echo(f"--overwrite: moved the earlier run {old} to {new}", err=True)


def _print_dry_run(cfg: RunConfig, *, fit_seq_len: int | None, gpu_memory_gib: float, suggest_layout: bool) -> None:
    from loongforge.train.context_plan import build_context_plan, format_context_plan
    from loongforge.train.dry_run import build_parallel_plan, format_parallel_plan
    from loongforge.train.pipeline_plan import pipeline_table, suggest_layouts, suggestion_text

    typer.echo("# resolved config")
    typer.echo(dump_yaml(cfg))
    typer.echo(format_parallel_plan(build_parallel_plan(cfg)))
    if cfg.parallel.pipeline_model_parallel_size > 1:
        typer.echo(pipeline_table(cfg))
    typer.echo(format_context_plan(build_context_plan(cfg, fit_seq_len=fit_seq_len, gpu_memory_gib=gpu_memory_gib)))
    if suggest_layout:
        typer.echo(suggestion_text(cfg, suggest_layouts(cfg, gpu_memory_gib=gpu_memory_gib)))


def _check_plan_only_options(dry_run: bool, fit_seq_len: int | None, suggest_layout: bool) -> None:
    # --fit-seq-len and --suggest-layout choose a layout to run with; they do not change a run that starts now.
    if fit_seq_len is not None and not dry_run:
        raise UsageError(f"--fit-seq-len {fit_seq_len} plans a layout and starts nothing; add --dry-run, then "
                         f"run with the overrides it prints")
    if suggest_layout and not dry_run:
        raise UsageError("--suggest-layout plans a layout and starts nothing; add --dry-run, then run with the "
                         "overrides it prints")


def train(
    overrides: OverridesArgument = None,
    preset: PresetOption = None,
    config: ConfigFileOption = None,
    list_presets: ListPresetsOption = False,
    show_preset: ShowPresetOption = None,
    dry_run: DryRunOption = False,
    fit_seq_len: FitSeqLenOption = None,
    gpu_memory_gib: GpuMemoryOption = 80.0,
    suggest_layout: SuggestLayoutOption = False,
    nproc_per_node: NprocPerNodeOption = None,
    resume: ResumeOption = False,
    output_dir: OutputDirOption = None,
    overwrite: OverwriteOption = False,
    verbose: VerboseOption = False,
) -> None:
    """Train a vision-language model from a preset, a YAML file and key=value overrides."""
    with cli_errors():
        if list_presets or show_preset:
            from loongforge.cli.presets_view import format_composed_preset, format_presets_table

            text = format_presets_table() if list_presets else format_composed_preset(show_preset)
            typer.echo(text)
            return
        _check_plan_only_options(dry_run, fit_seq_len, suggest_layout)
        # No launch information (None): validated at parallel.world_size, as a dry run plans it.
        launch_world_size = launch_env.resolve_world_size(nproc_per_node)
        cfg = load_run_config(
            preset or DEFAULT_PRESET,
            config_file=config,
            overrides=[*(overrides or []), *_output_dir_override(output_dir), *_verbose_override(verbose)],
            world_size=launch_world_size,
        )
        cfg = _with_folder_model(cfg, list(overrides or []), config, dry_run=dry_run)
        if dry_run:
            _print_dry_run(cfg, fit_seq_len=fit_seq_len, gpu_memory_gib=gpu_memory_gib, suggest_layout=suggest_layout)
            return
        if launch_world_size is None:
            _check_single_process_launch(cfg)
        from loongforge.train.launch import run, worker_server_started

        # Local workers' fork server imports the training code while the checks run (they import torch).
        with worker_server_started(cfg, nproc_per_node=nproc_per_node):
            _prepare_run(cfg, resume=resume, overwrite=overwrite)
        run(cfg, nproc_per_node=nproc_per_node, resume=resume, command_line=list(sys.argv))
