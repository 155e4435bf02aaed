"""``loongforge fit-cost``: fit the compute-cost model to PROFILE.jsonl files and write COST.json.

Both fits (``nnls``, ``smoothmax``) run on every call, so each report compares the chosen one
with the other; each is also cross-validated by step. ``check_cost_model`` fits nothing: it
reports how well an existing COST.json predicts the profiles.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from loongforge.balance.cost_model import CostModel
from loongforge.balance.fit import (
    FitError,
    check_model,
    cross_validate,
    fit,
    observations_from_profile,
    plot_fit,
)
from loongforge.config.errors import ConfigError, InputError
from loongforge.config.schema import LanguageConfig
from loongforge.config.validate import build_run_config
from loongforge.models.decoder.layer_costs import LINEAR_ATTENTION, gated_delta_rule_flops
from loongforge.models.flops import attention_width, decoder_layer_types
from loongforge.models.registry import get_family
from loongforge.profile.profile_file import read_profile

METHODS = ("nnls", "smoothmax")
Echo = Callable[[str], None]


def _num(metrics: dict, key: str, digits: int) -> str:
    value = metrics.get(key)
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(name: str, report: dict) -> list[str]:
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


def check_cost_model(path: Path, obs, echo: Echo) -> None:
    """Report how well the model at ``path`` predicts ``obs`` (micro-batches and step times)."""
    try:
        model = CostModel.load(path)
    except ValueError as exc:
        raise InputError(f"--check: {exc}") from None
    result = check_model(model, obs)
    mb, step = result["micro_batch"], result["step_time"]
    echo(f"{path} on {mb['count']} micro-batches: R^2 {_num(mb, 'r2', 4)}, median error "
         f"{_num(mb, 'median_ape_pct', 2)}%, p90 {_num(mb, 'p90_ape_pct', 2)}%; measured/predicted "
         f"median {result['scale']:.3f}")
    echo(f"step time ({step['count']} steps, fixed overhead {result['step_overhead_s']:.3f} s): "
         f"median error {_num(step, 'median_ape_pct', 2)}%, p90 {_num(step, 'p90_ape_pct', 2)}%")


def _fit_all(obs, method: str, exclude: list[str], warn: Echo) -> dict:
    """The chosen method's fit, then every other method's for the comparison."""
    results = {method: fit(obs, method, exclude=exclude)}
    for other in METHODS:
        if other not in results:
            try:
                results[other] = fit(obs, other, exclude=exclude)
            except FitError as exc:
                warn(f"warning: {other} comparison not fitted: {exc}")
    return results


def _cross_validate_all(obs, results: dict, exclude: list[str], warn: Echo) -> dict:
    cv = {}
    for name in results:
        try:
            cv[name] = cross_validate(obs, name, exclude=exclude)
        except FitError as exc:  # a fold too small to identify the terms
            warn(f"warning: {name} cross-validation skipped: {exc}")
    return cv


def _report_lines(method: str, results: dict, cv: dict) -> list[str]:
    lines = []
    for name in (method, *[m for m in results if m != method]):
        lines += format_report(name, results[name].report)
        if cv.get(name):
            c = cv[name]
            lines.append(f"  {c['folds']}-fold by step: micro-batch median error "
                         f"{_num(c['micro_batch'], 'median_ape_pct', 2)}%, step time median error "
                         f"{_num(c['step_time'], 'median_ape_pct', 2)}% "
                         f"(p90 {_num(c['step_time'], 'p90_ape_pct', 2)}%)")
    return lines


def flops_crossover_length(model: dict, *, loss_share: float) -> dict:
    """Where causal attention FLOPs equal the linear FLOPs per sample, from the architecture.

    ``model``: the profile env's model config (dict). Forward+backward FLOPs of a sample of
    length L: attention 6*w*layers*L^2 / 2 * 2 (QK^T and AV, causal) = 6*w*layers*L^2 (w: the attention
    width, ``flops.attention_width``: heads x head_dim, which need not be h), linear
    6*params_per_layer*layers*L, where a mixture-of-experts layer counts the parameters one token
    runs through (router and its top-k experts: the family's ``active`` count), plus
    the LM head, which runs on loss tokens only (6*vocab*h*loss_share*L). Returns the crossover
    without and with the head. A hybrid decoder's linear-attention layers (``layer_types``) have no
    L^2 term: only its attention layers (full or sliding-window) count in ``layers`` of the attention, and the linear
    layers' work that is not a parameter's (the gated delta rule; ``linear_attention_token_flops``) joins
    the linear side, as many parameters as it takes FLOPs / 2.
    """
    model_cfg = build_run_config({"model": model}).model
    lang = model_cfg.language
    h = lang.hidden_size
    count = get_family(model_cfg.family).count_parameters
    without_layers = replace(model_cfg, language=replace(lang, num_layers=0))
    layer_parameters = count(model_cfg)["active"] - count(without_layers)["active"]
    linear = layer_parameters + linear_attention_token_flops(lang) / 2
    # every layer but a linear-attention one has the L^2 term (a sliding-window layer's kernel runs the whole square)
    attention = attention_width(lang) * sum(kind != LINEAR_ATTENTION for kind in decoder_layer_types(lang))
    head = loss_share * lang.vocab_size * h
    if not attention:  # every layer linear: the attention never catches up
        return {"layers_only": math.inf, "with_lm_head": math.inf, "loss_share": loss_share}
    return {"layers_only": linear / attention, "with_lm_head": (linear + head) / attention, "loss_share": loss_share}


def linear_attention_token_flops(lang: LanguageConfig) -> int:
    """Forward FLOPs per token of the linear-attention layers beyond their parameters' 2 each (the
    convolution's taps are parameters too): the gated delta rule (``models.flops``); 0 without such layers."""
    linear_layers = decoder_layer_types(lang).count(LINEAR_ATTENTION)
    if not linear_layers:
        return 0
    return linear_layers * gated_delta_rule_flops(1, lang.linear_attention)


def _crossover_line(model: CostModel, profile) -> Optional[str]:
    """The fitted a*L^2 = b*L length against the FLOP count's (recorded in ``model.accuracy``)."""
    if "language" not in (profile.env.get("model") or {}) or not model.crossover_length():
        return None
    mbs = profile.micro_batches
    share = sum(r.get("loss_tokens", 0) for r in mbs) / max(1.0, sum(r["features"]["sum_L"] for r in mbs))
    flops = flops_crossover_length(profile.env["model"], loss_share=share)
    model.accuracy["flops_crossover_length"] = flops
    if model.coefficients["n_loss"] > 0:  # the head has its own term: b*L is the layers
        return (f"crossover a*L^2 = b*L: fitted {model.crossover_length():.0f} tokens; FLOP count "
                f"{flops['layers_only']:.0f} (transformer layers; the LM head on {share:.0%} of "
                f"tokens is the n_loss term)")
    return (f"crossover a*L^2 = b*L: fitted {model.crossover_length():.0f} tokens; FLOP "
            f"count {flops['with_lm_head']:.0f} (LM head on {share:.0%} of tokens), "
            f"{flops['layers_only']:.0f} without the head")


def run_fit_cost(profiles: Sequence[Path], *, output: Path, method: str = "nnls", clock: str = "wall",
                 step_time: str = "fwd_bwd", exclude: Sequence[str] = (), include_warmup: bool = False,
                 check: Optional[Path] = None, plot: Optional[Path] = None, echo: Echo = print,
                 warn: Echo = print) -> Optional[CostModel]:
    """Fit (or, with ``check``, only evaluate) and write ``output``; every line goes to ``echo``."""
    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not one of {' | '.join(METHODS)}")
    profile = read_profile(list(profiles))
    obs = observations_from_profile(profile, include_warmup=include_warmup, clock=clock, step_time=step_time)
    if check is not None:
        check_cost_model(check, obs, echo)
        return None
    exclude = list(exclude)
    results = _fit_all(obs, method, exclude, warn)
    chosen = results[method]
    for warning in chosen.warnings:
        warn(f"warning: {warning}")
    model = chosen.model
    env = {k: v for k, v in profile.env.items() if k not in ("kind", "model")}
    model.environment = {**env, "profiles": profile.sources, "clock": clock, "step_time": step_time}
    cv = _cross_validate_all(obs, results, exclude, warn)
    model.accuracy = {**chosen.report, "comparison": {
        name: {"held_out_micro_batch": r.report["held_out_micro_batch"],
               "step_time": r.report["step_time"], "cross_validated": cv.get(name, {})}
        for name, r in results.items()}, "warnings": chosen.warnings, "excluded": exclude}
    for line in _report_lines(method, results, cv):
        echo(line)
    echo("coefficients (s): " + ", ".join(f"{t} {v:.3e}" for t, v in model.coefficients.items())
         + f", micro_batch_overhead_s {model.micro_batch_overhead_s:.3e}")
    crossover = _crossover_line(model, profile)
    if crossover:
        echo(crossover)
    model.save(output)
    if plot is not None:
        plot_fit(plot, results, title=f"{profile.env.get('preset')} on {profile.env.get('device')}")
        echo(f"wrote {plot}")
    echo(f"wrote {output}")
    return model
