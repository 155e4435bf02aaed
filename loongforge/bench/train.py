"""``loongforge bench train``: balancing measured in real training, next to what the model predicts.

One invocation trains the same steps twice on the same data and layout, recording every rank's
micro-batches (``loongforge profile`` records): once with ``balance.enabled=false`` (rows in
arrival order) and once with ``balance.enabled=true`` pricing samples with COST.json. Both runs
see the same samples in every step (the same seed and row stream; only who trains what changes).

Measured, per run, over the non-warm-up steps:
- step time: the slowest rank's whole ``train_step`` (forward, backward, gradient sync, optimizer);
- compute: each rank's forward+backward compute (megatron's compute intervals, no collectives);
  the step's critical path is the slowest rank's compute;
- wait: each rank's (slowest rank's compute - own compute), the time it idles at the gradient sync.

Predicted, from the same records and COST.json only (no timings): each rank's compute as the sum
of the model's micro-batch predictions from the recorded features, so the off run's prediction is
the arrival assignment's modelled cost and the on run's is the plan's.

Compared (``compare_runs``): per step, the slowest rank's compute over the mean rank's, measured
and predicted; raw step times are reported too, with the drift of the machine's speed between the
two runs that they include.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from loongforge.balance.cost_model import CostModel
from loongforge.balance.fit import record_features
from loongforge.bench.plots import save_figure, subplots
from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.config.overrides import Override
from loongforge.config.presets import DEFAULT_PRESET
from loongforge.parallel import launch_env
from loongforge.config.schema import RunConfig
from loongforge.models.registry import get_family
from loongforge.profile.features import record_samples
from loongforge.profile.profile_file import Profile, read_profile
from loongforge.profile.throughput import Throughput, flop_options
from loongforge.calibrate.profile_run import profile_overrides, run_profile

ORDERS = ("off-on", "on-off")


@dataclass
class RunMeasure:
    """Means over the measured (non-warm-up) steps of one run; seconds unless noted."""

    name: str
    steps: int
    step_s: float  # slowest rank's train_step
    max_compute_s: float  # slowest rank's forward+backward compute
    mean_compute_s: float  # mean over ranks
    wait_s: float  # mean over ranks of (slowest compute - own compute)
    wait_by_rank_s: list[float]
    max_over_mean: float  # measured compute, mean over steps of max/mean over ranks
    predicted_max_s: float  # model: slowest rank's predicted compute
    predicted_max_over_mean: float
    model_tflops_per_gpu: float = 0.0  # model FLOPs of the step / step time / ranks
    mfu: Optional[float] = None  # against logging.peak_tflops (None: not given, e.g. on CPU)
    encoder_flops_share: float = 0.0  # the vision encoder's and projector's share of the FLOPs


def _per_step_rank(profile: Profile, values) -> dict[int, dict[int, float]]:
    table: dict[int, dict[int, float]] = {}
    for record in profile.micro_batches:
        if record.get("warmup"):
            continue
        per_rank = table.setdefault(int(record["step"]), {})
        per_rank[int(record["rank"])] = per_rank.get(int(record["rank"]), 0.0) + values(record)
    return table


def step_flops(profile: Profile, cfg: RunConfig) -> dict[int, tuple[float, float]]:
    """Per measured step: (model FLOPs, of which encoder) over every micro-batch of every replica,
    each counted once (the TP and PP ranks of a replica record the same micro-batch)."""
    family, options = get_family(cfg.model.family), flop_options(cfg)
    totals: dict[int, tuple[float, float]] = {}
    seen = set()
    for record in profile.micro_batches:
        key = (int(record["step"]), int(record.get("dp_rank", record["rank"])), int(record["micro_batch"]))
        if record.get("warmup") or key in seen:
            continue
        seen.add(key)
        flops = family.training_flops(cfg.model, record_samples(record), options)
        total, encoder = totals.get(key[0], (0.0, 0.0))
        totals[key[0]] = (total + flops.total, encoder + flops.vision + flops.projector)
    return totals


def measure_run(name: str, profile: Profile, model: CostModel, cfg: RunConfig) -> RunMeasure:
    measured = _per_step_rank(profile, lambda r: r["forward_s"] + r["backward_s"])
    predicted = _per_step_rank(profile, lambda r: float(model.predict_micro_batch(
        np.array(record_features(r)))))
    steps = sorted(measured)
    if not steps:
        raise ValueError(f"{name}: the profile has no measured steps (all warm-up?); raise --steps")
    ranks = sorted(measured[steps[0]])
    compute = np.array([[measured[s][r] for r in ranks] for s in steps])  # [steps, ranks]
    model_compute = np.array([[predicted[s][r] for r in ranks] for s in steps])  # [steps, ranks]
    step_s: dict[int, float] = {}
    for record in profile.steps:
        if not record.get("warmup"):
            step_s[int(record["step"])] = max(step_s.get(int(record["step"]), 0.0), float(record["step_s"]))
    slowest = compute.max(axis=1, keepdims=True)  # [steps, 1]
    flops = step_flops(profile, cfg)
    throughput = Throughput(model_flops=sum(flops[s][0] for s in steps), encoder_flops=sum(flops[s][1] for s in steps),
                            step_s=sum(step_s[s] for s in steps), world_size=len({int(r["rank"]) for r in profile.steps}),
                            peak_tflops=cfg.logging.peak_tflops)
    return RunMeasure(
        name=name, steps=len(steps),
        step_s=float(np.mean([step_s[s] for s in steps])),
        max_compute_s=float(slowest.mean()),
        mean_compute_s=float(compute.mean()),
        wait_s=float((slowest - compute).mean()),
        wait_by_rank_s=[float(w) for w in (slowest - compute).mean(axis=0)],
        max_over_mean=float((compute.max(axis=1) / compute.mean(axis=1)).mean()),
        predicted_max_s=float(model_compute.max(axis=1).mean()),
        predicted_max_over_mean=float((model_compute.max(axis=1) / model_compute.mean(axis=1)).mean()),
        model_tflops_per_gpu=throughput.tflops_per_gpu, mfu=throughput.mfu,
        encoder_flops_share=throughput.encoder_share,
    )



@dataclass
class TrainBenchResult:
    off: RunMeasure
    on: RunMeasure
    measured_step_gain: float  # step_s(off) / step_s(on) - 1: raw, includes machine-speed drift
    work_drift: float  # mean rank compute(on) / (off) - 1: 0 on a steady machine (same work)
    measured_balance_gain: float  # compute max/mean(off) / max/mean(on) - 1: per step, drift-free
    predicted_balance_gain: float  # the same from the model's per-rank predictions

    @property
    def gap_pp(self) -> float:
        """Measured minus predicted balance gain, in percentage points."""
        return 100.0 * (self.measured_balance_gain - self.predicted_balance_gain)

    def to_dict(self) -> dict:
        return {"off": asdict(self.off), "on": asdict(self.on),
                "measured_step_gain": self.measured_step_gain, "work_drift": self.work_drift,
                "measured_balance_gain": self.measured_balance_gain,
                "predicted_balance_gain": self.predicted_balance_gain, "gap_pp": self.gap_pp}


def compare_runs(off: RunMeasure, on: RunMeasure) -> TrainBenchResult:
    """Gains as throughput (x_off / x_on - 1), like ``bench balance``'s "gain vs none".

    Both runs train the same samples in every step, so each step's mean rank compute is the same
    work; a machine that runs faster or slower between the runs shifts it (``work_drift``).
    The slowest rank's compute divided by the mean, per step, is free of that drift: it is what
    balancing changes, measured and predicted on the same micro-batches.
    """
    return TrainBenchResult(
        off=off, on=on,
        measured_step_gain=off.step_s / on.step_s - 1.0,
        work_drift=on.mean_compute_s / off.mean_compute_s - 1.0,
        measured_balance_gain=off.max_over_mean / on.max_over_mean - 1.0,
        predicted_balance_gain=off.predicted_max_over_mean / on.predicted_max_over_mean - 1.0,
    )


def format_report(result: TrainBenchResult) -> str:
    rows = ["| run | steps | step time (s) | slowest rank compute (s) | mean rank compute (s) | "
            "wait per rank (s) | compute max/mean | predicted max/mean | model TFLOP/s/GPU | MFU | encoder FLOPs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in (result.off, result.on):
        mfu = "n/a" if run.mfu is None else f"{run.mfu:.1%}"
        rows.append(f"| balance {run.name} | {run.steps} | {run.step_s:.3f} | {run.max_compute_s:.3f} | "
                    f"{run.mean_compute_s:.3f} | {run.wait_s:.3f} "
                    f"({', '.join(f'{w:.3f}' for w in run.wait_by_rank_s)}) | {run.max_over_mean:.4f} | "
                    f"{run.predicted_max_over_mean:.4f} | {run.model_tflops_per_gpu:.4g} | {mfu} | "
                    f"{run.encoder_flops_share:.1%} |")
    rows += ["",
             f"balance gain (slowest / mean rank compute, per step): measured "
             f"{100 * result.measured_balance_gain:+.2f}%, predicted {100 * result.predicted_balance_gain:+.2f}% "
             f"(gap {result.gap_pp:+.2f} pp)",
             f"wait at the gradient sync: {result.off.wait_s:.3f} -> {result.on.wait_s:.3f} s per rank per step",
             f"raw step time: {result.off.step_s:.3f} -> {result.on.step_s:.3f} s "
             f"({100 * result.measured_step_gain:+.2f}%); the same work ran "
             f"{100 * result.work_drift:+.2f}% {'longer' if result.work_drift > 0 else 'shorter'} per rank in "
             f"the balanced run (machine speed between the runs)"]
    return "\n".join(rows)


def plot_runs(path: Path, off_profile: Profile, on_profile: Profile, result: TrainBenchResult) -> None:
    """Per-step compute of every rank, off (left) and on (right): the gap is the wait."""
    fig, axes = subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, profile, run in ((axes[0], off_profile, result.off), (axes[1], on_profile, result.on)):
        table = _per_step_rank(profile, lambda r: r["forward_s"] + r["backward_s"])
        steps = sorted(table)
        for rank in sorted(table[steps[0]]):
            ax.plot(steps, [table[s][rank] for s in steps], marker="o", label=f"rank {rank}")
        ax.set_title(f"balance {run.name}: mean wait {run.wait_s:.2f} s/step, step {run.step_s:.2f} s")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("forward+backward compute (s)")
    axes[1].legend()
    fig.suptitle(f"balance gain (slowest/mean rank compute) measured {100 * result.measured_balance_gain:+.1f}%, "
                 f"predicted {100 * result.predicted_balance_gain:+.1f}%")
    save_figure(fig, path)


def bench_overrides(*, balanced: bool, cost: Path) -> list:
    """The two runs differ in these settings only (values, so the path is not reparsed as YAML)."""
    values = {("balance", "enabled"): balanced, ("balance", "cost_model"): str(cost) if balanced else None}
    return [Override(f"bench:{'.'.join(key)}", key, delete=False, value=value) for key, value in values.items()]


def run_train_bench(out: Path, *, cost: Path, preset: Optional[str] = None, config_file: Optional[Path] = None,
                    data: Sequence[str] = (), overrides: Sequence = (), steps: int = 12, warmup_steps: int = 2,
                    nproc_per_node: Optional[int] = None, order: str = "off-on", report_only: bool = False,
                    command_line: Sequence[str] = (),
                    progress: Optional[Callable[[str], None]] = None) -> tuple[TrainBenchResult, str]:
    """Train (or, with ``report_only``, reread) the off and on runs into ``out``; write train.md,
    train.json and train.png there. Returns the result and the report's text."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {' | '.join(ORDERS)}")
    if warmup_steps >= steps:
        raise ValueError(f"{warmup_steps} warm-up steps leave no measured step of {steps}")
    try:
        model = CostModel.load(cost)
    except ValueError as exc:
        raise InputError(f"--cost: {exc}") from None
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    world = launch_env.resolve_world_size(nproc_per_node) or 1
    sequence = (("off", False), ("on", True))
    runs: dict[str, Profile] = {}
    configs: dict[str, RunConfig] = {}
    for name, balanced in (sequence if order == "off-on" else sequence[::-1]):
        output = out / f"{name}.jsonl"
        cfg = configs[name] = load_run_config(
            preset or DEFAULT_PRESET, config_file=config_file, world_size=world, overrides=[
                *overrides, *profile_overrides(list(data), output, steps),
                *bench_overrides(balanced=balanced, cost=cost.resolve())])
        if report_only:
            if not output.is_file():
                raise InputError(f"--report-only: no {output}; run without --report-only first")
        else:
            if progress is not None:
                progress(f"training {steps} steps with balance.enabled={str(balanced).lower()}")
            run_profile(cfg, output, nproc_per_node=nproc_per_node, sweep=False, warmup_steps=warmup_steps,
                        command_line=list(command_line))
        runs[name] = read_profile([output])
    result = compare_runs(*(measure_run(name, runs[name], model, configs[name]) for name in ("off", "on")))
    report = format_report(result)
    plot_runs(out / "train.png", runs["off"], runs["on"], result)
    (out / "train.json").write_text(json.dumps({**result.to_dict(), "order": order}, indent=2) + "\n")
    (out / "train.md").write_text(f"```\n{' '.join(command_line)}\n```\n\n{report}\n\n"
                                  "![per-rank compute](train.png)\n")
    return result, report
