"""``loongforge bench``: benchmarks, one subcommand each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import UsageError, cli_errors
from loongforge.cli.options import ConfigFileOption, NprocPerNodeOption, PresetOption

# The default cost model describes Qwen2.5-VL-7B; its preset gives the matching seq_len and image rules.
BALANCE_PRESET = "qwen2.5vl-7b"

app = typer.Typer(name="bench", help="Benchmarks: load balancing (simulated and trained), packing.", no_args_is_help=True,
                  add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. 8,32,128") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r}: expected positive integers, e.g. 8,32,128")
    return values


@app.command("balance")
def balance(
    data: Annotated[list[str], typer.Option(
        "--data", metavar="PATH", show_default=False,
        help="Packed folder (manifest.jsonl), OmniBal CSV, MathVista/COCO json or conversation "
             "files; repeat for more; all form one pool.")],
    preset: Annotated[Optional[str], typer.Option(
        "--preset", "-p", metavar="NAME", show_default=False,
        help=f"Preset whose tokenizer, image rules and data.seq_len apply. Default: {BALANCE_PRESET} "
             "(the model the default cost model describes).")] = None,
    cost: Annotated[Optional[Path], typer.Option(
        "--cost", metavar="COST.json", show_default=False,
        help="Cost model from `loongforge fit-cost`. "
             "Default: the documented qwen2.5vl-7b H100 model.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", min=1, metavar="N", show_default=False,
        help="Tokens per micro-batch. Default: the preset's data.seq_len.")] = None,
    dp: Annotated[str, typer.Option(
        "--dp", metavar="8,32,...", help="DP sizes.")] = "8,32,128,256,512,1024",
    ga: Annotated[str, typer.Option("--ga", metavar="1,4", help="Micro-batches per rank per step.")] = "1,4",
    steps: Annotated[int, typer.Option(
        "--steps", min=1, metavar="N", help="Simulated steps per (DP, GA).")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sample draws.")] = 0,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write balance.md (table + settings) and gain_vs_dp.png here. Default: bench_balance/.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object {rows: [...]} only.")] = False,
) -> None:
    """Simulate DP load balancing on real sample costs: none / token / reference / loongforge."""
    from loongforge.balance.planner import PlanError
    from loongforge.bench.balance import describe_bench, format_table, plot_gain, run_balance_bench
    from loongforge.config.loader import load_run_config

    with cli_errors():
        dp_sizes, micro_batches = _int_list(dp, "--dp"), _int_list(ga, "--ga")
        preset = preset or BALANCE_PRESET
        if seq_len is None:
            seq_len = load_run_config(preset).data.seq_len
        try:
            bench = run_balance_bench(data, preset=preset, seq_len=seq_len, cost=cost,
                                      dp_sizes=dp_sizes, micro_batches=micro_batches, steps=steps,
                                      seed=seed)
        except (PlanError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        if as_json:
            typer.echo(json.dumps({"rows": bench.rows}))
            return
        table, about = format_table(bench.rows), describe_bench(bench)
        typer.echo(table)
        typer.echo(about)
        out = out or Path("bench_balance")
        out.mkdir(parents=True, exist_ok=True)
        plot_gain(bench.rows, out / "gain_vs_dp.png")
        (out / "balance.md").write_text(f"{table}\n\n```\n{about}\n```\n")
        typer.echo(f"wrote {out / 'balance.md'} and {out / 'gain_vs_dp.png'}")


@app.command("pack")
def pack(
    data_root: Annotated[Optional[Path], typer.Option(
        "--data-root", metavar="DIR", show_default=False,
        help="The shared data folder (coco2017/, mathvista/, arena_hard/, llamafactory/). "
             "Default: ../shared/data beside the repository, or $LOONGFORGE_SHARED_DATA.")] = None,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="Preset whose tokenizer and image rules size the samples.")]
        = "qwen2.5vl-7b",
    seq_len: Annotated[str, typer.Option("--seq-len", metavar="8192,32768", help="Pack capacities.")]
        = "8192,32768",
    plan_samples: Annotated[int, typer.Option(
        "--plan-samples", min=1, metavar="N", help="Samples for the plan-speed run.")] = 1_000_000,
    scan_samples: Annotated[int, typer.Option(
        "--scan-samples", min=1, metavar="N", help="Samples for the scan-speed run.")] = 4000,
    workers: Annotated[str, typer.Option("--workers", metavar="1,2", help="Worker counts for the scan run.")]
        = "1,2",
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write pack.md (tables) and pack.png (fill ratios, length histogram) here. Default: bench_pack/.")]
        = None,
) -> None:
    """Fill ratio of bfd/ffd/balanced vs first-fit and greedy knapsack on real sets; plan and scan speed."""
    import os

    from loongforge.bench.pack import plot, report, run_pack_bench
    from loongforge.config.errors import InputError

    with cli_errors():
        root = data_root or Path(os.environ.get("LOONGFORGE_SHARED_DATA",
                                                Path(__file__).resolve().parents[2].parent / "shared" / "data"))
        if not (root / "coco2017" / "captions_val2017.json").exists():
            raise InputError(f"--data-root {root}: no coco2017/captions_val2017.json; point it at the shared data")
        bench = run_pack_bench(root, preset=preset, seq_lens=tuple(_int_list(seq_len, "--seq-len")),
                               plan_samples=plan_samples, scan_samples=scan_samples,
                               scan_workers=tuple(_int_list(workers, "--workers")),
                               on_progress=lambda message: typer.echo(f"... {message}", err=True))
        out = out or Path("bench_pack")
        out.mkdir(parents=True, exist_ok=True)
        plot(bench, out / "pack.png")
        text = report(bench, "pack.png")
        (out / "pack.md").write_text(text)
        typer.echo(text)
        typer.echo(f"wrote {out / 'pack.md'} and {out / 'pack.png'}")


@app.command("train")
def train(
    inputs: Annotated[Optional[list[str]], typer.Argument(
        metavar="[DATA...] [KEY=VALUE...]", show_default=False,
        help="Dataset files (as for data.paths; default: the preset's data) and dotted overrides.")] = None,
    cost: Annotated[Path, typer.Option(
        "--cost", metavar="COST.json", show_default=False,
        help="Cost model from `loongforge fit-cost` for this model and machine; the balanced run "
             "prices samples with it and the prediction uses it.")] = None,
    preset: PresetOption = None,
    config: ConfigFileOption = None,
    steps: Annotated[int, typer.Option("--steps", min=2, metavar="N", help="Steps per run.")] = 12,
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, metavar="N", help="First steps of each run left out of the figures.")] = 2,
    nproc_per_node: NprocPerNodeOption = None,
    out: Annotated[Path, typer.Option(
        "--out", metavar="DIR", help="Write train.md, train.json, train.png and both profiles here.")]
        = Path("bench_train"),
    order: Annotated[str, typer.Option(
        "--order", metavar="off-on|on-off",
        help="Which run goes first. A machine that speeds up or slows down over time favours one "
             "order; running both orders (two --out folders) cancels that.")] = "off-on",
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="Train nothing: rebuild the report from off.jsonl and on.jsonl in --out "
                              "(e.g. with another --cost).")] = False,
) -> None:
    """Train the same steps with balancing off and on; measured step time and wait vs the prediction."""
    import sys

    from loongforge.bench.train import bench_overrides, compare_runs, format_report, measure_run, plot_runs
    from loongforge.balance.cost_model import CostModel
    from loongforge.cli.profile import split_inputs
    from loongforge.config.errors import InputError
    from loongforge.config.loader import load_run_config
    from loongforge.config.presets import DEFAULT_PRESET
    from loongforge.parallel import launcher
    from loongforge.profile.records import read_profile
    from loongforge.profile.run import profile_overrides, run_profile

    with cli_errors():
        if cost is None:
            raise UsageError("--cost COST.json is required: profile (`loongforge profile --sweep`) and fit "
                             "(`loongforge fit-cost`) this model on this machine first")
        if warmup_steps >= steps:
            raise UsageError(f"--warmup-steps {warmup_steps} leaves no measured step of --steps {steps}")
        try:
            model = CostModel.load(cost)
        except ValueError as exc:
            raise InputError(f"--cost: {exc}") from None
        data, overrides = split_inputs(inputs or [])
        out = out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        world = launcher.resolve_world_size(nproc_per_node) or 1
        if order not in ("off-on", "on-off"):
            raise UsageError(f"--order {order!r} is not one of off-on | on-off")
        runs = {}
        sequence = (("off", False), ("on", True))
        for name, balanced in (sequence if order == "off-on" else sequence[::-1]):
            output = out / f"{name}.jsonl"
            if report_only:
                if not output.is_file():
                    raise InputError(f"--report-only: no {output}; run without --report-only first")
                runs[name] = read_profile([output])
                continue
            cfg = load_run_config(preset or DEFAULT_PRESET, config_file=config, world_size=world, overrides=[
                *overrides, *profile_overrides(data, output, steps),
                *bench_overrides(balanced=balanced, cost=cost.resolve())])
            typer.echo(f"... training {steps} steps with balance.enabled={str(balanced).lower()}", err=True)
            run_profile(cfg, output, nproc_per_node=nproc_per_node, sweep=False, warmup_steps=warmup_steps,
                        command_line=list(sys.argv))
            runs[name] = read_profile([output])
        result = compare_runs(measure_run("off", runs["off"], model), measure_run("on", runs["on"], model))
        report = format_report(result)
        plot_runs(out / "train.png", runs["off"], runs["on"], result)
        (out / "train.json").write_text(json.dumps({**result.to_dict(), "order": order}, indent=2) + "\n")
        (out / "train.md").write_text(f"```\n{' '.join(sys.argv)}\n```\n\n{report}\n\n![per-rank compute](train.png)\n")
        typer.echo(report)
        typer.echo(f"wrote {out / 'train.md'}, {out / 'train.json'} and {out / 'train.png'}")
