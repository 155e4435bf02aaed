"""``loongforge fit-cost``: fit the compute-cost model to PROFILE.jsonl files, write COST.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import cli_errors

METHODS = ("nnls", "smoothmax")


def _num(metrics: dict, key: str, digits: int) -> str:
    value = metrics.get(key)
    return "n/a" if value is None else f"{value:.{digits}f}"


def _format_report(name: str, report: dict) -> list[str]:
    mb, step = report["held_out_micro_batch"], report["step_time"]
    obs = report["observations"]
    shares = ", ".join(f"{t} {v * 100:.1f}%" for t, v in report["term_shares"].items() if v > 0)
    lines = [f"{name}: {obs['train']} observations in {obs['train_steps']} steps fitted, "
             f"{obs['held_out']} in {obs['held_out_steps']} steps held out",
             f"  held-out micro-batch: R^2 {_num(mb, 'r2', 4)}, median error "
             f"{_num(mb, 'median_ape_pct', 2)}%, p90 {_num(mb, 'p90_ape_pct', 2)}%",
             f"  held-out step time:   R^2 {_num(step, 'r2', 4)}, median error "
             f"{_num(step, 'median_ape_pct', 2)}%, p90 {_num(step, 'p90_ape_pct', 2)}%",
             f"  term shares (held-out): {shares}"]
    if report.get("crossover_length"):
        lines.append(f"  attention = linear at L = {report['crossover_length']:.0f} tokens")
    return lines


def _report_check(path: Path, obs) -> None:
    from loongforge.balance.cost_model import CostModel
    from loongforge.balance.fit import check_model
    from loongforge.config.errors import InputError

    try:
        model = CostModel.load(path)
    except ValueError as exc:
        raise InputError(f"--check: {exc}") from None
    result = check_model(model, obs)
    mb, step = result["micro_batch"], result["step_time"]
    typer.echo(f"{path} on {mb['count']} micro-batches: R^2 {_num(mb, 'r2', 4)}, median error "
               f"{_num(mb, 'median_ape_pct', 2)}%, p90 {_num(mb, 'p90_ape_pct', 2)}%; measured/predicted "
               f"median {result['scale']:.3f}")
    typer.echo(f"step time ({step['count']} steps, fixed overhead {result['step_overhead_s']:.3f} s): "
               f"median error {_num(step, 'median_ape_pct', 2)}%, p90 {_num(step, 'p90_ape_pct', 2)}%")


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
    from loongforge.balance.fit import (
        FitError, cross_validate, fit, flops_crossover_length, observations_from_profile, plot_fit)
    from loongforge.cli.errors import UsageError
    from loongforge.profile.records import read_profile

    with cli_errors():
        if method not in METHODS:
            raise UsageError(f"--method {method!r} is not one of {' | '.join(METHODS)}")
        profile = read_profile(profiles)
        obs = observations_from_profile(profile, include_warmup=include_warmup, clock=clock,
                                        step_time=step_time)
        if check is not None:
            _report_check(check, obs)
            return
        exclude = list(exclude or [])
        results = {method: fit(obs, method, exclude=exclude)}
        for other in METHODS:  # the comparison is part of every report
            if other not in results:
                try:
                    results[other] = fit(obs, other, exclude=exclude)
                except FitError as exc:
                    typer.echo(f"warning: {other} comparison not fitted: {exc}", err=True)
        chosen = results[method]
        for warning in chosen.warnings:
            typer.echo(f"warning: {warning}", err=True)
        model = chosen.model
        env = {k: v for k, v in profile.env.items() if k not in ("kind", "model")}
        model.environment = {**env, "profiles": profile.sources, "clock": clock,
                             "step_time": step_time}
        cv = {}
        for name in results:
            try:
                cv[name] = cross_validate(obs, name, exclude=exclude)
            except FitError as exc:  # a fold too small to identify the terms
                typer.echo(f"warning: {name} cross-validation skipped: {exc}", err=True)
        model.accuracy = {**chosen.report, "comparison": {
            name: {"held_out_micro_batch": r.report["held_out_micro_batch"],
                   "step_time": r.report["step_time"], "cross_validated": cv.get(name, {})}
            for name, r in results.items()},
            "warnings": chosen.warnings, "excluded": exclude}
        model.save(output)
        for name in (method, *[m for m in results if m != method]):
            for line in _format_report(name, results[name].report):
                typer.echo(line)
            if cv.get(name):
                c = cv[name]
                typer.echo(f"  {c['folds']}-fold by step: micro-batch median error "
                           f"{_num(c['micro_batch'], 'median_ape_pct', 2)}%, step time median error "
                           f"{_num(c['step_time'], 'median_ape_pct', 2)}% "
                           f"(p90 {_num(c['step_time'], 'p90_ape_pct', 2)}%)")
        typer.echo("coefficients (s): " + ", ".join(
            f"{t} {v:.3e}" for t, v in model.coefficients.items())
            + f", micro_batch_overhead_s {model.micro_batch_overhead_s:.3e}")
        if "language" in (profile.env.get("model") or {}) and model.crossover_length():
            mbs = profile.micro_batches
            share = sum(r.get("loss_tokens", 0) for r in mbs) / max(1.0, sum(r["features"]["sum_L"] for r in mbs))
            flops = flops_crossover_length(profile.env["model"], loss_share=share)
            model.accuracy["flops_crossover_length"] = flops
            if model.coefficients["n_loss"] > 0:  # the head has its own term: b*L is the layers
                typer.echo(f"crossover a*L^2 = b*L: fitted {model.crossover_length():.0f} tokens; FLOP count "
                           f"{flops['layers_only']:.0f} (transformer layers; the LM head on {share:.0%} of "
                           f"tokens is the n_loss term)")
            else:
                typer.echo(f"crossover a*L^2 = b*L: fitted {model.crossover_length():.0f} tokens; FLOP "
                           f"count {flops['with_lm_head']:.0f} (LM head on {share:.0%} of tokens), "
                           f"{flops['layers_only']:.0f} without the head")
            model.save(output)
        if plot is not None:
            plot_fit(plot, results, title=f"{profile.env.get('preset')} on {profile.env.get('device')}")
            typer.echo(f"wrote {plot}")
        typer.echo(f"wrote {output}")
