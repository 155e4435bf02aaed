"""Fitting the cost model to measured compute times (``loongforge fit-cost``; online in ``train``).

Two methods, on the same observations:

``nnls`` (default): non-negative least squares over every rank's every micro-batch,
    forward+backward seconds = features . coefficients + micro_batch_overhead_s, on relative
    residuals (weights 1/t), Huber-reweighted against timing outliers.
    Hundreds of observations per run, each a rank's own compute (no waiting in collectives).
``smoothmax`` (the reference system's method, for comparison): one observation per step, the
    step time, fitted by the log-sum-exp maximum over ranks (alpha = 20 per second) of each rank's
    predicted load, coefficients bounded >= 0 (L-BFGS-B).

Validation is held out by step (a random quarter of the steps, never the micro-batches of a step
split across both sides). Before fitting, every term is checked for identifiability: a term that
is zero in every observation (no images profiled) is reported and left out; terms that are
collinear in this profile (e.g. every sample the same length, so sum L^2, sum L and N move
together) stop the fit with a message naming them and what to profile.

Pure numpy + scipy: no torch, no torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from loongforge.balance.cost_model import TERMS, CostModel
from loongforge.config.errors import InputError

SMOOTHMAX_ALPHA = 20.0  # per second, as in the reference system
HOLDOUT_FRACTION = 0.25
# Robust reweighting: residuals beyond HUBER_K robust standard deviations count linearly.
HUBER_K = 1.345
ROBUST_ITERATIONS = 10
OVERHEAD = "micro_batch_overhead"  # the intercept column's name in diagnostics
# Singular values below this fraction of the largest (of the column-normalised design) mean
# the terms in that direction cannot be told apart; below WEAK they are identified but shaky.
RANK_TOLERANCE = 1e-7
WEAK_TOLERANCE = 1e-3

_REMEDY = {
    "sum_L2": "profile samples of several different lengths, short to near data.seq_len "
              "(`loongforge profile --sweep`)",
    "sum_L": "profile samples of several different lengths (`loongforge profile --sweep`)",
    "N": "profile packed rows with different numbers of samples (`loongforge profile --sweep`)",
    "sum_P2": "profile images of several different sizes (`loongforge profile --sweep`)",
    "sum_P": "profile images of several different sizes (`loongforge profile --sweep`)",
    "n_img": "profile rows with different numbers of images (`loongforge profile --sweep`)",
    "n_loss": "profile samples whose answer (loss) shares differ (`loongforge profile --sweep` varies "
              "them; profiles of one fixed share cannot separate it from sum_L)",
    OVERHEAD: "profile packed rows with different numbers of samples (`loongforge profile --sweep`)",
}


class FitError(InputError):
    """The observations cannot determine the cost model; the message says which term and why."""


@dataclass
class Observations:
    """Per-rank per-micro-batch observations, and per-step step times."""

    features: np.ndarray  # [n, 6] in TERMS order
    seconds: np.ndarray  # [n] forward + backward compute of that micro-batch on that rank
    step: np.ndarray  # [n] step key
    rank: np.ndarray  # [n]
    step_seconds: dict = field(default_factory=dict)  # step key -> {rank: step time (s)}

    def __post_init__(self):
        if len(self.seconds) == 0:
            raise FitError("no observations to fit (empty profile, or only warm-up steps); "
                           "profile more steps (`loongforge profile --steps N`)")
        bad = ~np.isfinite(self.seconds) | (self.seconds < 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FitError(f"{int(bad.sum())} observations have negative or NaN times (first: step "
                           f"{int(self.step[i])} rank {int(self.rank[i])}: {self.seconds[i]}); "
                           f"profile again")
        if not np.isfinite(self.features).all() or (self.features < 0).any():
            raise FitError("observations have negative or NaN features; profile again")

    def subset(self, mask: np.ndarray) -> "Observations":
        keys = set(np.unique(self.step[mask]).tolist())
        return Observations(self.features[mask], self.seconds[mask], self.step[mask],
                            self.rank[mask], {k: v for k, v in self.step_seconds.items() if k in keys})


CLOCKS = ("wall", "cpu")


STEP_TIMES = ("fwd_bwd", "step")


def record_features(record: dict) -> list[float]:
    """A micro_batch record's features in ``TERMS`` order. Profiles written before the n_loss term
    carry the same count as the record's ``loss_tokens``."""
    features = record["features"]
    if "n_loss" not in features:
        features = {**features, "n_loss": record.get("loss_tokens", 0)}
    return [float(features[t]) for t in TERMS]


def observations_from_records(micro_batches: list[dict], steps: list[dict], *,
                              include_warmup: bool = False, clock: str = "wall",
                              step_time: str = "fwd_bwd", step_key: str = "step") -> Observations:
    """Flatten profile records (warm-up steps left out unless asked).

    ``clock``: ``wall`` (wall-clock seconds) or ``cpu`` (the process's CPU seconds, immune to
    other processes on a shared CPU machine; see ``profile.timers``).
    ``step_time``: what step-time predictions are checked against: ``fwd_bwd`` (the schedule:
    every micro-batch plus the gradient sync, which is what balancing changes) or ``step`` (the
    whole train_step, optimizer update included, which is the same on every rank).
    """
    if clock not in CLOCKS:
        raise FitError(f"clock {clock!r} is not one of {' | '.join(CLOCKS)}")
    if step_time not in STEP_TIMES:
        raise FitError(f"step time {step_time!r} is not one of {' | '.join(STEP_TIMES)}")
    suffix = "_cpu_s" if clock == "cpu" else "_s"
    mbs = [r for r in micro_batches if include_warmup or not r.get("warmup")]
    if mbs and f"forward{suffix}" not in mbs[0]:
        raise FitError(f"the profile has no {clock}-clock times (CPU times are recorded on CPU "
                       f"runs only); use --clock wall")
    features = np.array([record_features(r) for r in mbs], dtype=np.float64)
    seconds = np.array([r[f"forward{suffix}"] + r[f"backward{suffix}"] for r in mbs], dtype=np.float64)
    step_seconds: dict = {}
    for r in steps:
        if include_warmup or not r.get("warmup"):
            step_seconds.setdefault(r[step_key], {})[int(r["rank"])] = float(r[f"{step_time}{suffix}"])
    return Observations(features.reshape(-1, len(TERMS)), seconds,
                        np.array([r[step_key] for r in mbs]), np.array([r["rank"] for r in mbs]),
                        step_seconds)


def observations_from_profile(profile, *, include_warmup: bool = False, clock: str = "wall",
                              step_time: str = "fwd_bwd") -> Observations:
    """Observations of a ``profile.records.Profile`` (steps keyed apart per file)."""
    return observations_from_records(profile.micro_batches, profile.steps,
                                     include_warmup=include_warmup, clock=clock,
                                     step_time=step_time, step_key="step_key")


def split_by_step(steps: np.ndarray, *, holdout_fraction: float = HOLDOUT_FRACTION,
                  seed: int = 0) -> np.ndarray:
    """Boolean mask over observations: True = training, False = held out (whole steps)."""
    unique = np.unique(steps)
    if len(unique) < 2 or holdout_fraction <= 0:
        return np.ones(len(steps), dtype=bool)
    count = max(1, int(round(len(unique) * holdout_fraction)))
    held = np.random.default_rng(seed).choice(unique, size=min(count, len(unique) - 1), replace=False)
    return ~np.isin(steps, held)


# --------------------------------------------------------------------------------------------
# Identifiability
# --------------------------------------------------------------------------------------------

@dataclass
class Identifiability:
    columns: list[str]  # the terms (and overhead) that will be fitted
    absent: list[str]  # zero in every observation: not fitted, coefficient 0
    weak: list[list[str]]  # nearly collinear groups: fitted, but with a warning
    warnings: list[str]


def _null_terms(vector: np.ndarray, names: list[str]) -> list[str]:
    weights = np.abs(vector) / np.abs(vector).max()
    return [name for name, w in zip(names, weights) if w > 0.1]


def check_identifiable(features: np.ndarray, *, intercept: bool,
                       exclude: Sequence[str] = ()) -> Identifiability:
    """Which terms the observations can determine; FitError names collinear ones.

    ``exclude``: terms the caller asked to leave out (coefficient 0, reported as such).
    """
    names = list(TERMS) + ([OVERHEAD] if intercept else [])
    unknown = [t for t in exclude if t not in names]
    if unknown:
        raise FitError(f"--exclude {', '.join(unknown)}: not a term; terms are {', '.join(names)}")
    X = _design(features, intercept)
    present = (np.abs(X).max(axis=0) > 0) & ~np.isin(names, list(exclude))
    absent = [n for n, p in zip(names, present) if not p]
    warnings = [f"term {n} excluded on request: its coefficient is 0, not fitted" if n in exclude
                else f"term {n} is zero in every observation, so it cannot be fitted and is set to 0: "
                     f"{_REMEDY[n]} if your data has it" for n in absent]
    columns = [n for n, p in zip(names, present) if p]
    Xs = X[:, present] / np.abs(X[:, present]).max(axis=0)
    if len(Xs) < len(columns):
        raise FitError(f"{len(Xs)} observations cannot determine {len(columns)} terms "
                       f"({', '.join(columns)}); profile more steps")
    _, s, vt = np.linalg.svd(Xs, full_matrices=False)
    dead = [i for i in range(len(s)) if s[i] < RANK_TOLERANCE * s[0]]
    if dead:
        groups = sorted({tuple(_null_terms(vt[i], columns)) for i in dead})
        lengths = sorted({round(math.sqrt(x)) for x in features[:, 0] / np.maximum(features[:, 2], 1)})
        detail = "; ".join(f"{', '.join(g)} move together ({'; '.join(dict.fromkeys(_REMEDY[t] for t in g))})"
                           for g in groups)
        raise FitError(f"rank-deficient profile: terms not identifiable: {detail}; or leave such "
                       f"terms out on purpose (fit-cost --exclude TERM). (The profile has "
                       f"{len(lengths)} distinct mean sample lengths.)")
    weak = [list(_null_terms(vt[i], columns)) for i in range(len(s)) if s[i] < WEAK_TOLERANCE * s[0]]
    warnings += [f"terms {', '.join(g)} are nearly collinear in this profile; their split is "
                 f"uncertain: {_REMEDY[g[0]]}" for g in weak]
    return Identifiability(columns, absent, weak, warnings)


def _design(features: np.ndarray, intercept: bool) -> np.ndarray:
    features = np.asarray(features, dtype=np.float64).reshape(-1, len(TERMS))
    if intercept:
        return np.hstack([features, np.ones((len(features), 1))])
    return features


# --------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------

def accuracy(predicted: np.ndarray, measured: np.ndarray) -> dict:
    """R^2, median and p90 absolute percentage error (in %), and the count."""
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    if len(measured) == 0:
        return {"count": 0}
    ape = np.abs(predicted - measured) / np.maximum(measured, 1e-12) * 100
    sst = float(((measured - measured.mean()) ** 2).sum())
    r2 = 1 - float(((measured - predicted) ** 2).sum()) / sst if sst > 0 else None  # JSON has no NaN
    return {"count": int(len(measured)), "r2": r2, "median_ape_pct": float(np.median(ape)),
            "p90_ape_pct": float(np.percentile(ape, 90))}


def _rank_loads(obs: Observations, per_micro_batch: np.ndarray) -> dict:
    """step key -> {rank: sum over that rank's micro-batches of ``per_micro_batch``}."""
    loads: dict = {}
    for s, r, v in zip(obs.step.tolist(), obs.rank.tolist(), per_micro_batch.tolist()):
        loads.setdefault(s, {}).setdefault(r, 0.0)
        loads[s][r] += v
    return loads


def step_times(obs: Observations) -> tuple[list, np.ndarray]:
    """(step keys, measured step time = slowest rank's) for steps with micro-batch observations."""
    keys = [k for k in sorted(obs.step_seconds) if k in set(obs.step.tolist())]
    return keys, np.array([max(obs.step_seconds[k].values()) for k in keys])


def nnls_step_overhead(model: CostModel, obs: Observations) -> float:
    """Median of (step time - slowest rank's measured compute) over ``obs``: grad sync + optimizer."""
    keys, measured = step_times(obs)
    loads = _rank_loads(obs, obs.seconds)
    gaps = [t - max(loads[k].values()) for k, t in zip(keys, measured)]
    return float(np.median(gaps)) if gaps else 0.0


def predict_step_nnls(model: CostModel, obs: Observations, overhead_s: float) -> np.ndarray:
    """Per-rank prediction: slowest rank's predicted compute + the measured fixed step overhead."""
    keys, _ = step_times(obs)
    loads = _rank_loads(obs, model.predict_micro_batch(obs.features))
    return np.array([max(loads[k].values()) + overhead_s for k in keys])


def _rank_features(obs: Observations, keys: list) -> list[np.ndarray]:
    """Per step: [ranks, 6] summed features of each rank's micro-batches."""
    out = []
    for k in keys:
        mask = obs.step == k
        ranks = np.unique(obs.rank[mask])
        out.append(np.stack([obs.features[mask & (obs.rank == r)].sum(axis=0) for r in ranks]))
    return out


def _smoothmax(loads: np.ndarray, alpha: float) -> float:
    top = loads.max()
    return float(top + np.log(np.exp(alpha * (loads - top)).sum()) / alpha)


def predict_step_smoothmax(model: CostModel, obs: Observations,
                           alpha: float = SMOOTHMAX_ALPHA) -> np.ndarray:
    keys, _ = step_times(obs)
    return np.array([_smoothmax(F @ model.vector, alpha) for F in _rank_features(obs, keys)])


# --------------------------------------------------------------------------------------------
# Fits
# --------------------------------------------------------------------------------------------

@dataclass
class FitResult:
    model: CostModel
    warnings: list[str]
    train: Observations
    held_out: Observations
    report: dict


def _nnls_coefficients(obs: Observations, ident: Identifiability, intercept: bool) -> CostModel:
    from scipy.optimize import nnls  # lazy: only fitting needs scipy; balance imports none otherwise

    names = list(TERMS) + ([OVERHEAD] if intercept else [])
    X = _design(obs.features, intercept)
    keep = [names.index(c) for c in ident.columns]
    scale = np.abs(X[:, keep]).max(axis=0)
    A = X[:, keep] / scale
    # Relative error is what matters across micro-batches from 64 to 8k tokens: weight by 1/t.
    w = 1.0 / np.maximum(obs.seconds, 1e-9)
    solution, _ = nnls(A * w[:, None], obs.seconds * w, maxiter=50 * len(keep))
    # Timing noise on a busy machine is one-sided and heavy-tailed (a preempted micro-batch is
    # slow, never fast): Huber reweighting keeps those few from pulling every coefficient.
    for _ in range(ROBUST_ITERATIONS):
        relative = (A @ solution - obs.seconds) * w
        mad = float(np.median(np.abs(relative - np.median(relative)))) * 1.4826
        if mad <= 0:
            break
        huber = np.minimum(1.0, HUBER_K * mad / np.maximum(np.abs(relative), 1e-12))
        rw = w * np.sqrt(huber)
        solution, _ = nnls(A * rw[:, None], obs.seconds * rw, maxiter=50 * len(keep))
    values = dict.fromkeys(names, 0.0)
    values.update({names[j]: float(v / s) for j, v, s in zip(keep, solution, scale)})
    overhead = values.pop(OVERHEAD, 0.0)
    return CostModel({t: values[t] for t in TERMS}, source="fit:nnls",
                     micro_batch_overhead_s=overhead)


def fit_nnls(obs: Observations, *, intercept: bool = True, holdout_fraction: float = HOLDOUT_FRACTION,
             seed: int = 0, exclude: Sequence[str] = ()) -> FitResult:
    """Non-negative least squares on per-rank per-micro-batch times, validated on held-out steps."""
    ident = check_identifiable(obs.features, intercept=intercept, exclude=exclude)
    is_train = split_by_step(obs.step, holdout_fraction=holdout_fraction, seed=seed)
    train, held = obs.subset(is_train), obs.subset(~is_train) if (~is_train).any() else obs.subset(is_train)
    check_identifiable(train.features, intercept=intercept, exclude=exclude)  # the training split too
    model = _nnls_coefficients(train, ident, intercept)
    warnings = list(ident.warnings)
    zeroed = [t for t in ident.columns if t in TERMS and model.coefficients[t] == 0.0]
    warnings += [f"term {t} was fitted to 0: its effect is below the measurement noise in this "
                 f"profile ({_REMEDY[t]} to measure it)" for t in zeroed]
    report = _report(model, train, held, method="nnls", ident=ident)
    overhead = nnls_step_overhead(model, train)
    report["step_time"] = accuracy(predict_step_nnls(model, held, overhead), step_times(held)[1])
    report["step_overhead_s"] = overhead
    model.accuracy = report
    return FitResult(model, warnings, train, held, report)


def fit_smoothmax(obs: Observations, *, alpha: float = SMOOTHMAX_ALPHA,
                  holdout_fraction: float = HOLDOUT_FRACTION, seed: int = 0,
                  exclude: Sequence[str] = ()) -> FitResult:
    """The reference method: fit smoothmax over ranks of predicted loads to the step times."""
    from scipy.optimize import minimize  # lazy: only fitting needs scipy; balance imports none otherwise

    ident = check_identifiable(obs.features, intercept=False,
                               exclude=[t for t in exclude if t != OVERHEAD])
    is_train = split_by_step(obs.step, holdout_fraction=holdout_fraction, seed=seed)
    train, held = obs.subset(is_train), obs.subset(~is_train) if (~is_train).any() else obs.subset(is_train)
    keys, target = step_times(train)
    if len(keys) < 2:
        raise FitError(f"smoothmax needs step times of at least 2 steps, the profile has {len(keys)}; "
                       f"profile more steps")
    keep = [TERMS.index(c) for c in ident.columns]
    per_step = [F[:, keep] for F in _rank_features(train, keys)]
    scale = np.abs(np.concatenate(per_step)).max(axis=0)
    per_step = [F / scale for F in per_step]

    def loss_and_grad(u):
        loss, grad = 0.0, np.zeros_like(u)
        for F, t in zip(per_step, target):
            loads = F @ u
            weights = np.exp(alpha * (loads - loads.max()))
            weights /= weights.sum()
            residual = _smoothmax(loads, alpha) - t
            loss += residual ** 2
            grad += 2 * residual * (weights @ F)
        return loss, grad

    # The reference starts from plain token counts: only the sum_L term, scaled to the step times.
    u0 = np.zeros(len(keep))
    token_col = ident.columns.index("sum_L")
    u0[token_col] = float(np.median([t / F[:, token_col].max() for F, t in zip(per_step, target)]))
    result = minimize(loss_and_grad, u0, jac=True, method="L-BFGS-B", bounds=[(0, None)] * len(keep))
    coefficients = dict.fromkeys(TERMS, 0.0)
    coefficients.update({TERMS[j]: float(v / s) for j, v, s in zip(keep, result.x, scale)})
    model = CostModel(coefficients, source="fit:smoothmax")
    report = _report(model, train, held, method="smoothmax", ident=ident)
    report["step_time"] = accuracy(predict_step_smoothmax(model, held, alpha), step_times(held)[1])
    report["alpha_per_s"] = alpha
    model.accuracy = report
    return FitResult(model, list(ident.warnings), train, held, report)


def _report(model: CostModel, train: Observations, held: Observations, *, method: str,
            ident: Identifiability) -> dict:
    predicted = model.predict_micro_batch(held.features)
    parts = held.features * model.vector
    total = float(parts.sum() + model.micro_batch_overhead_s * len(held.features))
    shares = {t: float(v / total) for t, v in zip(TERMS, parts.sum(axis=0))} if total > 0 else {}
    if total > 0:
        shares["micro_batch_overhead"] = model.micro_batch_overhead_s * len(held.features) / total
    return {
        "method": method,
        "observations": {"train": int(len(train.seconds)), "held_out": int(len(held.seconds)),
                         "train_steps": int(len(np.unique(train.step))),
                         "held_out_steps": int(len(np.unique(held.step)))},
        "held_out_micro_batch": accuracy(predicted, held.seconds),
        "train_micro_batch": accuracy(model.predict_micro_batch(train.features), train.seconds),
        "term_shares": shares,
        "not_identified": ident.absent,
        "weakly_identified": ident.weak,
        "crossover_length": model.crossover_length(),
    }


def cross_validate(obs: Observations, method: str, *, folds: int = 4, seed: int = 0,
                   exclude: Sequence[str] = ()) -> dict:
    """K-fold by step: every step is predicted once by a model that never saw it.

    Steadier than one held-out quarter when a profile has few steps; the fit-cost report and the
    benchmark compare methods on this.
    """
    steps = np.unique(obs.step)
    folds = min(folds, len(steps))
    if folds < 2:
        return {}
    order = np.random.default_rng(seed).permutation(steps)
    mb_pred, mb_true, step_pred, step_true = [], [], [], []
    for k in range(folds):
        held_steps = order[k::folds]
        is_held = np.isin(obs.step, held_steps)
        train, held = obs.subset(~is_held), obs.subset(is_held)
        result = fit(train, method, holdout_fraction=0.0, exclude=exclude)
        model = result.model
        mb_pred.append(model.predict_micro_batch(held.features))
        mb_true.append(held.seconds)
        if method == "nnls":
            step_pred.append(predict_step_nnls(model, held, nnls_step_overhead(model, train)))
        else:
            step_pred.append(predict_step_smoothmax(model, held))
        step_true.append(step_times(held)[1])
    return {"folds": folds,
            "micro_batch": accuracy(np.concatenate(mb_pred), np.concatenate(mb_true)),
            "step_time": accuracy(np.concatenate(step_pred), np.concatenate(step_true))}


def fit(obs: Observations, method: str = "nnls", **kwargs) -> FitResult:
    if method == "nnls":
        return fit_nnls(obs, **kwargs)
    if method == "smoothmax":
        return fit_smoothmax(obs, **kwargs)
    raise FitError(f"--method {method!r} is not one of nnls | smoothmax")


def check_model(model: CostModel, obs: Observations) -> dict:
    """How well an existing model predicts observations it was not fitted to (another data set,
    machine or day): per micro-batch, the scale measured / predicted, and per step (slowest rank's
    predicted compute + this profile's median fixed step overhead)."""
    if len(obs.seconds) == 0:
        raise FitError("the profile has no micro-batch observations to check against")
    predicted = model.predict_micro_batch(obs.features)
    _, measured_steps = step_times(obs)
    overhead = nnls_step_overhead(model, obs)
    return {"micro_batch": accuracy(predicted, obs.seconds),
            "scale": float(np.median(obs.seconds / np.maximum(predicted, 1e-12))),
            "step_time": accuracy(predict_step_nnls(model, obs, overhead), measured_steps),
            "step_overhead_s": overhead}


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------

def plot_fit(path, results: dict[str, FitResult], *, title: Optional[str] = None) -> None:
    """Predicted vs measured: per micro-batch (left) and per step (right), one colour per method."""
    import matplotlib  # lazy: only plotting needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend on import

    fig, (ax_mb, ax_step) = plt.subplots(1, 2, figsize=(11, 4.8))
    colours = {"nnls": "tab:blue", "smoothmax": "tab:orange"}
    top_mb = top_step = 0.0
    for name, result in results.items():
        held, model = result.held_out, result.model
        pred = model.predict_micro_batch(held.features)
        acc = result.report["held_out_micro_batch"]
        ax_mb.scatter(held.seconds * 1e3, pred * 1e3, s=10, alpha=0.6, color=colours.get(name),
                      label=f"{name}: median {acc['median_ape_pct']:.1f}%, p90 {acc['p90_ape_pct']:.1f}%")
        keys, measured = step_times(held)
        if name == "nnls":
            step_pred = predict_step_nnls(model, held, result.report["step_overhead_s"])
        else:
            step_pred = predict_step_smoothmax(model, held, result.report.get("alpha_per_s", SMOOTHMAX_ALPHA))
        sacc = result.report["step_time"]
        ax_step.scatter(measured * 1e3, step_pred * 1e3, s=18, alpha=0.8, color=colours.get(name),
                        label=f"{name}: median {sacc.get('median_ape_pct', float('nan')):.1f}%")
        top_mb = max(top_mb, held.seconds.max() * 1e3, pred.max() * 1e3)
        if len(measured):
            top_step = max(top_step, measured.max() * 1e3, step_pred.max() * 1e3)
    for ax, top, what in ((ax_mb, top_mb, "micro-batch forward+backward"), (ax_step, top_step, "step")):
        ax.plot([0, top], [0, top], color="grey", lw=1, ls="--")
        ax.set_xlabel(f"measured {what} (ms)")
        ax.set_ylabel(f"predicted {what} (ms)")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_title(f"held-out {what}", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
