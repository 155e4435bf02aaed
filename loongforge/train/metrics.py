"""What a training run shows: a tqdm bar, one log line every N steps, TensorBoard scalars."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from loongforge.models.decoder.moe_balance import ExpertLoad
from loongforge.profile.throughput import Throughput

# One JSON line per training step, in the run folder, and one per evaluation of the validation
# sets ({"step": N, "validation": {set: {"loss", "perplexity", ...}}}, after step N's line).
METRICS_FILE = "metrics.jsonl"


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: Optional[float]
    lr: float
    tokens: int  # real (non-padding) tokens processed this step over all DP ranks
    step_s: float
    data_wait_s: float
    # balance.enabled: {"applied": bool, "before": max/LB of the arrival assignment, "after": trained}
    balance: Optional[dict] = None
    # Measured imbalance: the longest minus the shortest gradient-sync time over ranks, i.e. how
    # long the first rank to finish its micro-batches waited for the last one (None at one rank).
    sync_wait_s: Optional[float] = None
    # parallel.encoder_dp=full: the most bytes any rank held for the step's precomputed vision
    # features (pixels it encoded, its features, the gathered features); None otherwise.
    vision_features_bytes: Optional[int] = None
    # Per-rank measures (runner.RANK_MEASURES: encoder time, step CPU time, peak memory, the pipeline
    # schedule's wall and CPU time), each a list in rank order with None where a rank has nothing to
    # measure (no encoder on its stage).
    by_rank: dict = field(default_factory=dict)
    # Mixture-of-experts models: the load-balancing loss (train.step.StepResult) and the tokens
    # each expert received (moe_balance.ExpertLoad); None otherwise.
    load_balancing_loss: Optional[float] = None
    expert_load: Optional[ExpertLoad] = None
    # Multi-token prediction: each MTP layer's loss (train.step.StepResult); None without MTP layers.
    mtp_losses: Optional[list[float]] = None
    # DeepSeek Sparse Attention: the indexer's KL loss and, in dense_warmup, the attention mass its top-k keeps
    # (train.step.StepResult); None otherwise.
    indexer_loss: Optional[float] = None
    indexer_topk_mass: Optional[float] = None
    # Model FLOPs, TFLOP/s per GPU, MFU and HFU of the step (profile.throughput); by_rank["model_tflop"]
    # holds each model replica's share (None on ranks that do not count: one per replica counts).
    throughput: Optional[Throughput] = None
    # Weighted data.paths (data.mixture): per source, the samples and tokens trained since the run
    # began (all ranks, cumulative across --resume) and its epochs read; None otherwise.
    sources: Optional[dict] = None
    # Preference training: TRL's metrics of the step by their names ("rewards/chosen", "logps/rejected",
    # "nll_loss", ..., train.preference_step.step_metrics), each a mean over the step's pairs; None for SFT.
    preference: Optional[dict] = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def flops_max_over_mean(self) -> Optional[float]:
        """The largest replica's model FLOPs over the mean: DP imbalance in work, beside sync_wait's
        imbalance in time (None with one replica)."""
        present = [value for value in self.by_rank.get("model_tflop") or () if value is not None]
        if len(present) < 2 or not sum(present):
            return None
        return max(present) / (sum(present) / len(present))


def _slowest(values: Optional[list]) -> Optional[float]:
    present = [value for value in values or () if value is not None]
    return max(present) if present else None


def format_log_line(m: StepMetrics, total_steps: int) -> str:
    grad = "n/a" if m.grad_norm is None else f"{m.grad_norm:.3f}"
    encoder_s = _slowest(m.by_rank.get("encoder_s"))
    return (f"step {m.step}/{total_steps} | loss {m.loss:.4f} | grad_norm {grad} | lr {m.lr:.3e} | "
            f"tokens/s {m.tokens_per_s:,.0f} | step {m.step_s:.2f}s | data_wait {m.data_wait_s:.3f}s"
            + ("" if m.sync_wait_s is None else f" | sync_wait {m.sync_wait_s:.3f}s")
            + ("" if encoder_s is None else f" | encoder max {encoder_s:.2f}s")
            + ("" if m.balance is None else
               f" | balance max/LB {m.balance['before']:.3f}->{m.balance['after']:.3f}"
               f" ({'applied' if m.balance['applied'] else 'skipped'})")
            + ("" if m.expert_load is None else f" | experts max/mean {m.expert_load.max_over_mean:.2f}")
            + ("" if m.mtp_losses is None else " | mtp loss " + " ".join(f"{v:.4f}" for v in m.mtp_losses))
            + ("" if m.preference is None else f" | reward accuracy {m.preference['rewards/accuracies']:.2f} | "
               f"margin {m.preference['rewards/margins']:.4f}")
            + ("" if m.indexer_loss is None else f" | indexer loss {m.indexer_loss:.4g}")
            + ("" if m.indexer_topk_mass is None else f" | top-k mass {m.indexer_topk_mass:.1%}")
            + _throughput_text(m))


def _throughput_text(m: StepMetrics) -> str:
    if m.throughput is None:
        return ""
    t = m.throughput
    mfu, hfu = ("n/a" if value is None else f"{value:.1%}" for value in (t.mfu, t.hfu))
    imbalance = m.flops_max_over_mean
    return (f" | {t.tflops_per_gpu:.3g} TFLOP/s/GPU | MFU {mfu} | HFU {hfu} | encoder {t.encoder_share:.0%} of FLOPs"
            + ("" if imbalance is None else f" | FLOPs max/mean {imbalance:.3f}"))


def read_metrics(path: Path, *, validation: bool = False) -> list[dict]:
    """The training steps' records of a ``metrics.jsonl``, or with ``validation`` its evaluations'."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if ("validation" in record) == validation]


def validation_line(step: int, total_steps: int, results: dict) -> str:
    """One console line for an evaluation: each set's loss, perplexity and loss tokens."""
    parts = [f"{name} loss {r.loss:.4f} ppl {r.perplexity:.4g} ({r.loss_tokens:,} tokens)"
             + (" [the set is smaller than training.eval_iters batches: samples counted again]" if r.wrapped else "")
             for name, r in results.items()]
    return f"validation after step {step}/{total_steps} | " + " | ".join(parts)


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the lines of steps <= ``step``: a run resumed from that step's checkpoint logs the
    later steps again, and each step must appear once in ``metrics.jsonl``."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)  # atomic: a kill here leaves the old or the new file, never half of one


@dataclass
class RunLogger:
    """Rank-0 reporter; every method is a no-op on other ranks."""

    output_dir: Path
    total_steps: int
    start_step: int
    log_interval: int
    enabled: bool
    tensorboard: bool = True
    progress_bar: bool = True
    history: list = field(default_factory=list)

    def __post_init__(self):
        self._bar = None
        self._writer = None
        if not self.enabled:
            return
        if self.progress_bar:
            self._bar = tqdm(total=self.total_steps, initial=self.start_step, desc="train",
                             unit="step", dynamic_ncols=True, file=sys.stderr)
        if self.tensorboard:
            # lazy: tensorboard only when logging.tensorboard is on
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._metrics_file = open(self.output_dir / METRICS_FILE, "a")

    def write(self, line: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar else print)(line)

    def log_step(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        self.history.append(m)
        record = {"step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
                  "tokens_per_s": m.tokens_per_s, "step_s": m.step_s, "data_wait_s": m.data_wait_s,
                  "sync_wait_s": m.sync_wait_s}
        if m.vision_features_bytes is not None:
            record["vision_features_bytes"] = m.vision_features_bytes
        if m.load_balancing_loss is not None:
            record["load_balancing_loss"] = m.load_balancing_loss
        if m.mtp_losses is not None:
            record["mtp_loss"] = m.mtp_losses
        if m.indexer_loss is not None:
            record["indexer_loss"] = m.indexer_loss
        if m.indexer_topk_mass is not None:
            record["indexer_topk_mass"] = m.indexer_topk_mass
        if m.expert_load is not None:
            record.update({"expert_tokens_min": m.expert_load.tokens_min, "expert_tokens_max": m.expert_load.tokens_max,
                           "expert_load_max_over_mean": m.expert_load.max_over_mean})
        if m.throughput is not None:
            t = m.throughput
            record.update({"model_flops": t.model_flops, "model_tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu,
                           "hardware_flops": t.model_flops if t.hardware_flops is None else t.hardware_flops,
                           "hardware_tflops_per_gpu": t.hardware_tflops_per_gpu, "hfu": t.hfu,
                           "encoder_flops_share": t.encoder_share,
                           "flops_max_over_mean": m.flops_max_over_mean})
        if m.balance is not None:
            record.update({"balance_applied": bool(m.balance["applied"]),
                           "balance_max_over_lb_before": m.balance["before"],
                           "balance_max_over_lb": m.balance["after"]})
        record.update({f"{name}_by_rank": values for name, values in m.by_rank.items()})
        if m.sources is not None:
            record["sources"] = m.sources
        if m.preference is not None:
            record.update({name: value for name, value in m.preference.items() if name != "loss"})
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self._writer:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not key.startswith("balance_"):
                    self._writer.add_scalar(f"train/{key}", value, m.step)
            for name, values in m.by_rank.items():
                if _slowest(values) is not None:
                    self._writer.add_scalar(f"ranks/{name}_max", _slowest(values), m.step)
            if m.balance is not None:
                self._writer.add_scalar("balance/max_over_lb", m.balance["after"], m.step)
                self._writer.add_scalar("balance/max_over_lb_before", m.balance["before"], m.step)
                self._writer.add_scalar("balance/applied", float(m.balance["applied"]), m.step)
                # Modelled gain of this step's plan: the slowest rank's cost drops by before/after.
                self._writer.add_scalar("balance/modelled_gain", m.balance["before"] / m.balance["after"] - 1,
                                        m.step)
        if self._bar:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{m.loss:.4f}", lr=f"{m.lr:.2e}")
        if m.step % self.log_interval == 0 or m.step == self.total_steps:
            self.write(format_log_line(m, self.total_steps))

    def log_validation(self, step: int, results: dict) -> None:
        """``results``: {set name: train.validation.ValidationLoss}."""
        if not self.enabled:
            return
        record = {"step": step, "validation": {name: result.as_dict() for name, result in results.items()}}
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self._writer:
            for name, result in results.items():
                self._writer.add_scalar(f"validation/{name}/loss", result.loss, step)
                self._writer.add_scalar(f"validation/{name}/perplexity", result.perplexity, step)
        self.write(validation_line(step, self.total_steps, results))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar:
            self._bar.close()
        if self._writer:
            self._writer.close()
        self._metrics_file.close()
