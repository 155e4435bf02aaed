"""``loongforge fit-cost``: fit the compute-cost model to PROFILE.jsonl files, write COST.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import cli_errors


def fit_cost(
    profiles: Annotated[list[Path], typer.Argument(
        metavar="PROFILE.jsonl...", help="Profiles written by `loongforge profile` (same model, device, dtype).")],
    output: Annotated[Path, typer.Option(
        "--output", metavar="COST.json", help="Where to write the fitted cost model.")] = Path("COST.json"),
    method: Annotated[str, typer.Option(
        "--method", metavar="nnls|smoothmax",
        help="nnls: per-rank per-micro-batch least squares (default); smoothmax: the reference "
             "system's fit of the max over ranks to step times. Both are reported.")] = "nnls",
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", metavar="FIG.png", help="Predicted vs measured plot (held-out), both methods.")] = None,
    clock: Annotated[str, typer.Option(
        "--clock", metavar="wall|cpu",
        help="wall: wall-clock compute time (default); cpu: process CPU time, for CPU profiles "
             "taken on a machine shared with other processes.")] = "wall",
    step_time: Annotated[str, typer.Option(
        "--step-time", metavar="fwd_bwd|step",
        help="Step time the step predictions are checked against: fwd_bwd (all micro-batches + "
             "gradient sync, what balancing changes; default) or step (optimizer included).")] = "fwd_bwd",
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", metavar="TERM",
        help="Leave a term out of the fit (coefficient 0, recorded in COST.json), e.g. the vision "
             "terms of a profile whose images all have one size. Repeatable.")] = None,
    check: Annotated[Optional[Path], typer.Option(
        "--check", metavar="COST.json",
        help="Fit nothing: report how well this existing model predicts the profiles (e.g. a sweep "
             "fit checked on real data, or last week's model on today's machine).")] = None,
    include_warmup: Annotated[bool, typer.Option(
        "--include-warmup", help="Also fit the steps the profile flagged as warm-up.")] = False,
) -> None:
    """Fit t = a*sum L^2 + b*sum L + c*N + d*sum P^2 + e*sum P + f*n_img + g*n_loss to measured compute times."""
    from loongforge.calibrate.fit_cost import run_fit_cost

    with cli_errors():
        run_fit_cost(profiles, output=output, method=method, clock=clock, step_time=step_time,
                     exclude=exclude or [], include_warmup=include_warmup, check=check, plot=plot,
                     echo=typer.echo, warn=lambda line: typer.echo(line, err=True))
