"""``loongforge bench balance``: the DP load-balancing strategies side by side on real sample costs.

Pipeline: read a pool of samples (tokens L and image patches P of each), price them with a cost model
(a COST.json from ``fit-cost`` or the documented qwen2.5vl-7b H100 default), simulate steps at each
(DP, micro-batches) with ``loongforge.bench.simulate``, and report one row per strategy.

Inputs ``--data`` understands (each file or folder; all of them form one pool):
- a packed folder (``manifest.jsonl`` from ``loongforge pack``: lines ``{"samples": [{"tokens": L,
  "patches": [P, ...]}, ...]}``);
- OmniBal cost CSVs (``vit_num,token_num,...``): ``token_num`` is L; each of the ``vit_num`` InternVL
  tiles is one 448x448 image = 32x32 = 1024 patches of 14 px before merging;
- the benchmark sets ``loongforge.bench.datasets`` reads: MathVista ``testmini.json``, COCO
  ``captions_*.json``, arena-hard model-answer JSONL, alpaca JSON (image sizes from their metadata);
- conversation files (JSON/JSONL/parquet; media sizes read from file headers).
Every chat and conversation is sized as ``pack`` measures it (``bench.datasets.SampleSizer``).
Samples longer than ``seq_len`` are dropped and counted, as packing drops them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from loongforge.balance.cost_model import CostModel, default_cost_model
from loongforge.bench.datasets import SampleSize, SampleSizer, chat_reader, is_omnibal_csv, omnibal_sizes
from loongforge.bench.plots import save_figure, subplots
from loongforge.bench.simulate import STRATEGY_NAMES, simulate
from loongforge.bench.tables import markdown_table
from loongforge.config.errors import InputError
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.samples import Reject

DEFAULT_DP_SIZES = (8, 32, 128, 256, 512, 1024)
DEFAULT_MICRO_BATCHES = (1, 4)
MANIFEST_NAME = "manifest.jsonl"


@dataclass
class SamplePool:
    tokens: list = field(default_factory=list)  # L per sample
    patches: list = field(default_factory=list)  # tuple of P per image/video, per sample
    loss: list = field(default_factory=list)  # loss tokens per sample; None where the source lacks them
    sources: dict = field(default_factory=dict)  # path -> samples read
    dropped_too_long: int = 0
    rejected: int = 0

    def add(self, tokens: int, patches: Sequence[int], seq_len: int, loss_tokens: Optional[int] = None) -> None:
        if tokens > seq_len:
            self.dropped_too_long += 1
            return
        self.tokens.append(int(tokens))
        self.patches.append(tuple(int(p) for p in patches))
        self.loss.append(None if loss_tokens is None else int(loss_tokens))

    def arrays(self, model: CostModel) -> tuple[np.ndarray, np.ndarray]:
        """(costs in seconds [n], tokens [n])."""
        tokens = np.asarray(self.tokens, dtype=np.int64)
        if model.coefficients["n_loss"] == 0:
            return model.sample_costs(tokens, self.patches), tokens
        if any(n is None for n in self.loss):
            raise InputError("the cost model prices loss tokens (n_loss > 0) but some --data sources carry "
                             "no answer lengths (OmniBal CSVs, older pack manifests); use conversation files, or a "
                             "cost model fitted with `fit-cost --exclude n_loss`")
        return model.sample_costs(tokens, self.patches, self.loss), tokens


# -------------------------------------------------------------------------------------- readers


def _read_manifest(folder: Path, pool: SamplePool, seq_len: int) -> None:
    path = folder / MANIFEST_NAME
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                for sample in json.loads(line)["samples"]:
                    pool.add(int(sample["tokens"]), sample.get("patches", []), seq_len, sample.get("loss_tokens"))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise InputError(f"{path}:{number}: not a pack manifest line ({exc}); expected "
                                 '{"samples": [{"tokens": L, "patches": [P, ...]}, ...]}') from None


def _add_sizes(sizes: Sequence[Union[SampleSize, Reject]], pool: SamplePool, seq_len: int) -> None:
    for size in sizes:
        if isinstance(size, SampleSize):
            pool.add(size.tokens, size.patches, seq_len, size.loss_tokens)
        else:
            pool.rejected += 1


def load_pool(paths: Sequence[str | Path], *, preset: str, seq_len: int) -> SamplePool:
    """Read every ``--data`` entry into one pool; raises InputError for what it cannot read."""
    pool = SamplePool()
    conversation_files: list[Path] = []
    sizer: Optional[SampleSizer] = None
    for entry in paths:
        path = Path(entry)
        before = len(pool.tokens)
        if path.is_dir() and (path / MANIFEST_NAME).is_file():
            _read_manifest(path, pool, seq_len)
        elif path.is_dir():
            conversation_files.append(path)
        elif not path.is_file():
            raise InputError(f"--data {entry}: no such file or folder")
        elif is_omnibal_csv(path):
            _add_sizes(omnibal_sizes(path), pool, seq_len)
        elif path.suffix == ".csv":
            raise InputError(f"--data {entry}: a CSV needs the OmniBal columns vit_num,token_num")
        elif (reader := chat_reader(path)) is not None:
            sizer = sizer or SampleSizer(preset)
            _add_sizes(sizer.size_chats(reader(path), str(path)), pool, seq_len)
        else:
            conversation_files.append(path)
        pool.sources[str(path)] = len(pool.tokens) - before
    if conversation_files:
        before = len(pool.tokens)
        try:
            source = ArrowSamples([str(p) for p in conversation_files])
        except FileNotFoundError as exc:
            raise InputError(f"--data: {exc}") from None
        sizer = sizer or SampleSizer(preset)
        _add_sizes([sizer.size(source.get(index)) for index in range(len(source))], pool, seq_len)
        for path in conversation_files:
            pool.sources[str(path)] = None  # counted together below
        pool.sources["conversation files"] = len(pool.tokens) - before
    if not pool.tokens:
        raise InputError(f"--data {list(map(str, paths))}: no usable samples (dropped as longer "
                         f"than seq_len={seq_len}: {pool.dropped_too_long}, rejected: {pool.rejected})")
    return pool


# ------------------------------------------------------------------------------------ the bench


@dataclass
class BalanceBench:
    rows: list
    pool: SamplePool
    cost_model: CostModel
    seq_len: int
    steps: int
    details: dict  # (dp, ga) -> strategy -> summed counters


def run_balance_bench(paths: Sequence[str | Path], *, preset: str, seq_len: int,
                      cost: Optional[Path] = None, dp_sizes: Sequence[int] = DEFAULT_DP_SIZES,
                      micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES, steps: int = 10,
                      seed: int = 0, strategies: Sequence[str] = STRATEGY_NAMES,
                      progress: Optional[Callable[[str], None]] = None) -> BalanceBench:
    model = CostModel.load(cost) if cost is not None else default_cost_model()
    pool = load_pool(paths, preset=preset, seq_len=seq_len)
    costs, tokens = pool.arrays(model)
    details: dict = {}

    def on_config(dp, m, results):
        details[(dp, m)] = {name: dict(res.extra) for name, res in results.items()}
        if progress is not None:
            progress(f"dp={dp} ga={m}: done")

    rows = simulate(costs, tokens, dp_sizes=dp_sizes, micro_batches=micro_batches, seq_len=seq_len,
                    steps=steps, seed=seed, strategies=strategies, on_config=on_config)
    return BalanceBench(rows=rows, pool=pool, cost_model=model, seq_len=seq_len, steps=steps,
                        details=details)


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows (also what the terminal shows)."""
    return markdown_table(
        ["DP", "GA", "strategy", "max/mean", "max/LB", "gain vs none", "plan ms p50", "plan ms p99"], "rrlrrrrr",
        ([r["dp"], r["ga"], r["strategy"], f"{r['max_over_mean']:.4f}", f"{r['max_over_lb']:.4f}",
          f"{100 * r['gain']:+.2f}%", f"{r['plan_ms_p50']:.1f}", f"{r['plan_ms_p99']:.1f}"] for r in rows))


def describe_bench(bench: BalanceBench) -> str:
    """Pool, cost model and per-config counters (skips, capacity overflows) in a few lines."""
    pool = bench.pool
    tokens = np.asarray(pool.tokens)
    lines = [f"pool: {len(tokens)} samples (L p50 {np.percentile(tokens, 50):.0f}, p99 "
             f"{np.percentile(tokens, 99):.0f}, max {tokens.max()}; "
             f"{sum(1 for p in pool.patches if p)} with images), dropped as > seq_len: "
             f"{pool.dropped_too_long}, rejected: {pool.rejected}",
             f"cost model: {bench.cost_model.source} {bench.cost_model.environment or ''}".rstrip(),
             f"seq_len={bench.seq_len}, steps per config={bench.steps}"]
    for (dp, m), per in bench.details.items():
        ref, tok = per.get("reference", {}), per.get("token", {})
        parts = []
        if ref:
            parts.append(f"reference applied {ref.get('applied', 0)}, skipped (sample > mean) "
                         f"{ref.get('skipped_sample_over_mean', 0)}, skipped (< 20% imbalance) "
                         f"{ref.get('skipped_balanced', 0)}, micro-batches over seq_len "
                         f"{ref.get('capacity_violations', 0)}")
        if tok:
            parts.append(f"token: micro-batches over seq_len {tok.get('capacity_violations', 0)}")
        if parts:
            lines.append(f"dp={dp} ga={m}: " + "; ".join(parts))
    return "\n".join(lines)


def plot_gain(rows: list[dict], path: Path, title: str = "") -> None:
    """PNG: modelled step-time gain over none vs DP, one line per strategy and GA."""
    colors = {"token": "tab:blue", "reference": "tab:orange", "loongforge": "tab:green"}
    styles = ["--", "-", ":", "-."]
    fig, ax = subplots(figsize=(7, 4.2))
    for k, m in enumerate(sorted({r["ga"] for r in rows})):
        for name, color in colors.items():
            pts = sorted((r["dp"], 100 * r["gain"]) for r in rows if r["ga"] == m and r["strategy"] == name)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, linestyle=styles[k % len(styles)],
                        label=f"{name}, GA={m}")
    ax.axhline(0.0, color="grey", linewidth=0.8)  # none
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data-parallel size")
    ax.set_ylabel("modelled step-time gain over none (%)")
    ax.set_title(title or "DP load balancing: gain vs DP")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
