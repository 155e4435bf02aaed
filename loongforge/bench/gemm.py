"""``loongforge bench gemm``: every linear layer's GEMMs of a preset, timed in bf16 and in FP8, and the
policy ``training.fp8=auto`` reads.

The layers come from the model family's own weight map (``ModelFamily.hf_rules``): each rule for a
linear's weight is applied to meta tensors of the HF shapes the config implies (``hf_shapes``), so
the shard this TP rank holds is the one training builds (fused QKV, gate+up, experts). For each
layer kind (``models.layers.layer_kinds.layer_kind``: tower and role, e.g. ``language.fc1``, ``vision.qkv``) at its
TP size, and each token count, one step is the forward GEMM and both backward GEMMs: bf16
``torch.matmul`` against each FP8 recipe (quantisation included, the cost FP8 really pays):
``models.layers.fp8.Fp8Matmul`` (``scaled_mm``) and, where the device has FP8 GEMMs and torchao
imports, torchao's float8 ``tensorwise`` and ``rowwise`` (``models.layers.fp8_torchao.float8_matmul``,
compiled on CUDA as training runs it; bf16 and scaled_mm run eager, as training runs them). On a
device without FP8 GEMMs (the CPU) torchao's recipes are not timed and the bench says so
(``GemmBench.unmeasured``): an emulated FP8 GEMM there says nothing about a GPU. With ``linear`` (the default) each kind is also timed as the whole layer training runs
(``bench.gemm_linear``: megatron's column- or row-parallel linear at its TP size in that many
processes, its sequence-parallel or tensor-parallel communication and FP8's quantisation
included); those rows decide the kind's policy, as they are what a run pays, and the GEMM rows
decide it only where the whole layer could not be timed. The policy keeps, per kind and TP, the
smallest token count from which FP8 stayed at least ``min_speedup`` times faster at every larger
measured count (None: it never did), for the recipe that makes the measured counts fastest in total
(``choose_recipe``), and says which rows decided (``decided_by``). FP8 is chosen only at counts where
it measured at least ``min_speedup`` times faster, so ``training.fp8=auto`` is never slower than bf16
on the measured shapes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from loongforge.config.errors import ConfigError
from loongforge.config.layout import LayoutKeys, layout_problems
from loongforge.bench.gemm_linear import micro_batches_to_time, time_whole_linears, whole_linear
from loongforge.bench.plots import save_figure, subplots
from loongforge.bench.model_step import time_steps
from loongforge.config.schema import RunConfig
from loongforge.models.layers.fp8 import (
    POLICY_FORMAT,
    RECIPES,
    SCALED_MM,
    Fp8Matmul,
    device_name,
    eligible,
    fp8_gemms_available,
    gemm_tokens,
    gemm_tp,
)
from loongforge.models.layers.fp8_torchao import TORCHAO_RECIPES, float8_matmul, torchao_available
from loongforge.models.layers.layer_kinds import layer_kind
from loongforge.models.registry import get_family

MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class LinearShape:
    kind: str  # models.layers.layer_kinds.layer_kind, e.g. "language.fc1"
    tp: int  # the TP size sharding it in the run
    out_features: int  # N of this rank's weight shard [N, K]
    in_features: int  # K
    run_tokens: int  # the rows its GEMMs get in one micro-batch of the run (models.layers.fp8.gemm_tokens)


def _fill(pattern: str) -> str:
    return pattern.replace("{i}", "0").replace("{e}", "0")


def linear_shapes(cfg: RunConfig) -> list[LinearShape]:
    """One entry per layer kind of ``cfg``'s model: its weight shard at the kind's TP size."""
    family = get_family(cfg.model.family)
    hf_shapes = family.hf_shapes(cfg.model)
    shapes = {}
    for rule in family.hf_rules(cfg.model):
        if not rule.megatron.endswith(".weight"):
            continue
        kind = layer_kind(_fill(rule.megatron)[: -len(".weight")])
        if kind is None or kind in shapes:
            continue
        tp = gemm_tp(cfg, kind)
        hf = [torch.empty(hf_shapes[_fill(pattern)], device="meta") for pattern in rule.hf]
        shard = (rule.transform.shard_expert(hf, 0, 0, tp) if rule.fuses_experts
                 else rule.transform.shard(hf, 0, tp))
        shapes[kind] = LinearShape(kind, tp, shard.shape[0], shard.shape[1], gemm_tokens(cfg, kind))
    return sorted(shapes.values(), key=lambda s: s.kind)


def default_token_counts(cfg: RunConfig, shapes: Sequence[LinearShape]) -> list[int]:
    """Powers of two from 128 up to the largest row count any layer kind gets in the run."""
    largest = max([cfg.data.seq_len, *(s.run_tokens for s in shapes)])
    counts, tokens = [], 128
    while tokens < largest:
        counts.append(tokens)
        tokens *= 2
    return counts + [tokens]


def torchao_recipes_to_time(device: torch.device) -> tuple[tuple[str, ...], Optional[str]]:
    """(torchao's recipes ``bench gemm`` times on ``device``, the line saying why none when none)."""
    if not fp8_gemms_available(device):
        return (), (f"torchao float8 (tensorwise, rowwise) not measured: {device} has no FP8 GEMMs (CUDA compute "
                    f"capability 8.9+), where they would be emulated")
    if not torchao_available():
        return (), "torchao float8 (tensorwise, rowwise) not measured: torchao does not import (pip install 'loongforge[fp8]')"
    return TORCHAO_RECIPES, None


def time_linear(shape: LinearShape, tokens: int, *, device: torch.device, steps: int, warmup: int,
                recipes: Sequence[str] = ()) -> dict:
    """Milliseconds of one forward + backward (three GEMMs) of ``shape`` on ``tokens`` rows, in bf16,
    in FP8 through ``Fp8Matmul`` (``fp8_ms``) and in each of torchao's ``recipes`` (``<recipe>_ms``)."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, shape.in_features, device=device, dtype=torch.bfloat16, generator=generator)
    weight = torch.randn(shape.out_features, shape.in_features, device=device, dtype=torch.bfloat16,
                         generator=generator) * shape.in_features ** -0.5
    grad_out = torch.randn(tokens, shape.out_features, device=device, dtype=torch.bfloat16, generator=generator)
    x.requires_grad_(True)
    weight.requires_grad_(True)

    def bf16_step() -> None:
        (x @ weight.t()).backward(grad_out)

    def fp8_step() -> None:
        Fp8Matmul.apply(x, weight).backward(grad_out)

    def torchao_step(recipe: str) -> Callable[[], None]:
        return lambda: float8_matmul(x, weight, recipe).backward(grad_out)

    def ms(step: Callable[[], None]) -> float:
        return 1e3 * statistics.mean(time_steps(step, device, steps=steps, warmup_steps=warmup))

    bf16_ms, fp8_ms = ms(bf16_step), ms(fp8_step)
    timing = {"tokens": tokens, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "speedup": bf16_ms / fp8_ms}
    for recipe in recipes:
        timing[f"{recipe}_ms"] = ms(torchao_step(recipe))
    return timing


def recipe_ms(timing: dict, recipe: str) -> Optional[float]:
    """A timing's milliseconds in ``recipe`` (None: not measured)."""
    return timing.get("fp8_ms" if recipe == SCALED_MM else f"{recipe}_ms")


def choose_recipe(timings: Sequence[dict], min_speedup: float) -> tuple[Optional[str], Optional[int]]:
    """(recipe, smallest token count) for one layer kind: each recipe measured at every count runs
    FP8 from its ``smallest_winning_tokens`` and bf16 below; the one whose measured counts take the
    least time in all wins (ties: the first in ``RECIPES``). (None, None): no recipe is at least
    ``min_speedup`` times faster at the largest count."""
    best_ms, best = sum(t["bf16_ms"] for t in timings), (None, None)
    for recipe in RECIPES:
        if not timings or any(recipe_ms(t, recipe) is None for t in timings):
            continue
        threshold = smallest_winning_tokens(
            [{"tokens": t["tokens"], "speedup": t["bf16_ms"] / recipe_ms(t, recipe)} for t in timings], min_speedup)
        if threshold is None:
            continue
        total = sum(recipe_ms(t, recipe) if t["tokens"] >= threshold else t["bf16_ms"] for t in timings)
        if total < best_ms:
            best_ms, best = total, (recipe, threshold)
    return best


def smallest_winning_tokens(timings: Sequence[dict], min_speedup: float) -> Optional[int]:
    """The smallest measured token count from which FP8 stays at least ``min_speedup`` times faster
    at every larger count; None when it is not faster at the largest."""
    winning = None
    for timing in sorted(timings, key=lambda t: t["tokens"], reverse=True):
        if timing["speedup"] < min_speedup:
            break
        winning = timing["tokens"]
    return winning


@dataclass
class GemmBench:
    preset: str
    device: str
    shapes: list[LinearShape]
    timings: dict = field(default_factory=dict)  # kind -> [timing dicts] of the three GEMMs
    linear_timings: dict = field(default_factory=dict)  # kind -> [timing dicts] of the whole layer
    sequence_parallel: dict = field(default_factory=dict)  # kind -> whether its layer splits the sequence
    min_speedup: float = MIN_SPEEDUP
    unmeasured: Optional[str] = None  # why torchao's recipes were not timed (None: they were)

    def deciding_timings(self, kind: str) -> tuple[str, list[dict]]:
        """("linear" | "gemms", the timings a kind's policy rests on): the whole layer's where measured."""
        if self.linear_timings.get(kind):
            return "linear", self.linear_timings[kind]
        return "gemms", self.timings.get(kind, [])

    def policy(self) -> dict:
        layers = {}
        for shape in self.shapes:
            decided_by, deciding = self.deciding_timings(shape.kind)
            recipe, min_tokens = choose_recipe(deciding, self.min_speedup) if eligible_shape(shape) else (None, None)
            layers[shape.kind] = {str(shape.tp): {
                "min_tokens": min_tokens, "recipe": recipe,
                "decided_by": decided_by, "shape": [shape.out_features, shape.in_features],
                "run_tokens": shape.run_tokens, "sequence_parallel": self.sequence_parallel.get(shape.kind, False),
                "timings": self.timings.get(shape.kind, []), "linear_timings": self.linear_timings.get(shape.kind, [])}}
        return {"format": POLICY_FORMAT, "version": 1, "preset": self.preset, "device": self.device,
                "min_speedup": self.min_speedup, "min_tokens_are": MIN_TOKENS_ARE, "torchao_unmeasured": self.unmeasured,
                "layers": layers}


# What a policy's thresholds count, written into it: a run compares them with each GEMM call's rows.
MIN_TOKENS_ARE = ("rows of one GEMM call as the layer sees it: a micro-batch's packed tokens (language; "
                  "gathered over TP under sequence parallelism), the tokens routed to one expert (experts), "
                  "patches (vision), merged patches (projector); run_tokens is the estimate for the preset")


def eligible_shape(shape: LinearShape) -> bool:
    return eligible(torch.empty(shape.out_features, shape.in_features, device="meta"))


def at_tensor_parallel(cfg: RunConfig, tp: int, sequence_parallel: Optional[bool] = None) -> RunConfig:
    """``cfg`` with language TP ``tp`` (vision and expert TP follow it unless the config sets them) and,
    when given, ``sequence_parallel`` (off at TP 1, where there is no sequence to split); a ConfigError
    when the model's widths do not split ``tp`` ways."""
    problems = layout_problems(cfg.model, get_family(cfg.model.family).layout, tp=tp, pp=1, vision_tp=None,
                               keys=LayoutKeys(tensor="--tp"))
    if problems:
        raise ConfigError(problems)
    split = cfg.parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
    return replace(cfg, parallel=replace(cfg.parallel, tensor_model_parallel_size=tp,
                                         sequence_parallel=split and tp > 1))


def run_gemm_bench(cfg: RunConfig, *, tokens: Optional[Sequence[int]], device: torch.device, steps: int,
                   warmup: int, linear: bool = True, micro_batches: Optional[int] = None,
                   log: Callable[[str], None] = lambda message: None) -> GemmBench:
    """The GEMM rows of every FP8-eligible layer kind of ``cfg`` and, with ``linear``, the whole
    layer's (``micro_batches`` per timed step: default ``gemm_linear.micro_batches_to_time``)."""
    shapes = linear_shapes(cfg)
    counts = list(tokens) if tokens else default_token_counts(cfg, shapes)
    layers = [whole_linear(shape, cfg) for shape in shapes]
    recipes, unmeasured = torchao_recipes_to_time(device)
    if unmeasured:
        log(unmeasured)
    bench = GemmBench(preset=cfg.preset or "custom", device=device_name(device), shapes=shapes,
                      sequence_parallel={layer.kind: layer.sequence_parallel for layer in layers}, unmeasured=unmeasured)
    measured = [s for s in shapes if eligible_shape(s)]
    for shape in shapes:
        if shape not in measured:
            log(f"{shape.kind}: weight shard {shape.out_features}x{shape.in_features} is not FP8-eligible "
                f"(widths must be multiples of 16): bf16")
    with tqdm(total=len(measured) * len(counts), desc="bench gemm", unit="shape", disable=None) as bar:
        for shape in measured:
            bench.timings[shape.kind] = []
            for count in counts:
                bench.timings[shape.kind].append(time_linear(shape, count, device=device, steps=steps, warmup=warmup,
                                                             recipes=recipes))
                bar.update(1)
    if linear:
        kinds = {shape.kind for shape in measured}
        bench.linear_timings = time_whole_linears(
            [layer for layer in layers if layer.kind in kinds], counts, device=device,
            micro_batches=micro_batches_to_time(cfg, micro_batches), steps=steps, warmup=warmup, log=log,
            recipes=recipes)
    return bench


def format_table(bench: GemmBench) -> str:
    lines = [f"FP8 vs bf16, one forward + backward (3 GEMMs) per layer kind, {bench.device} ({bench.preset})",
             "", "| layer kind | TP | weight shard | tokens | bf16 ms | fp8 ms | speedup | torchao tensorwise ms | "
             "torchao rowwise ms |", "|---|---|---|---|---|---|---|---|---|"]
    policy = bench.policy()["layers"]
    for shape in bench.shapes:
        for timing in bench.timings.get(shape.kind, []):
            lines.append(f"| {shape.kind} | {shape.tp} | {shape.out_features}x{shape.in_features} | {timing['tokens']} | "
                         f"{timing['bf16_ms']:.3f} | {timing['fp8_ms']:.3f} | {timing['speedup']:.2f}x |"
                         + _torchao_cells(timing))
    if bench.linear_timings:
        lines += ["", "The whole linear as training runs it (megatron's column/row-parallel layer: TP communication, "
                  "quantisation, the weight quantised once per step), per micro-batch:", "",
                  "| layer kind | TP | SP | tokens | micro-batches | bf16 ms | fp8 ms | speedup | fp8 error | "
                  "torchao tensorwise ms | torchao rowwise ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for shape in bench.shapes:
            for timing in bench.linear_timings.get(shape.kind, []):
                lines.append(f"| {shape.kind} | {shape.tp} | {'yes' if bench.sequence_parallel.get(shape.kind) else 'no'} | "
                             f"{timing['tokens']} | {timing['micro_batches']} | {timing['bf16_ms']:.3f} | "
                             f"{timing['fp8_ms']:.3f} | {timing['speedup']:.2f}x | {timing['relative_error']:.1e} |"
                             + _torchao_cells(timing))
    if bench.unmeasured:
        lines += ["", bench.unmeasured]
    lines += ["", f"policy (per kind the recipe making the measured counts fastest, FP8 from the smallest token count "
              f"where it stays >= {bench.min_speedup:.2f}x faster):"]
    for shape in bench.shapes:
        entry = policy[shape.kind][str(shape.tp)]
        decided = "the whole linear" if entry["decided_by"] == "linear" else "the GEMMs alone"
        chosen = ("bf16 (never faster)" if entry["min_tokens"] is None
                  else f"fp8 ({entry['recipe']}) from {entry['min_tokens']} tokens") + f", by {decided}"
        in_run = "fp8" if entry["min_tokens"] is not None and shape.run_tokens >= entry["min_tokens"] else "bf16"
        lines.append(f"  {shape.kind} (TP {shape.tp}): {chosen}; this run's {shape.run_tokens} tokens -> {in_run}")
    return "\n".join(lines)


def _torchao_cells(timing: dict) -> str:
    return "".join(f" {timing[f'{recipe}_ms']:.3f} |" if f"{recipe}_ms" in timing else " - |"
                   for recipe in TORCHAO_RECIPES)


def plot_speedups(bench: GemmBench, path: Path) -> None:
    figure, axes = subplots(figsize=(8, 5))
    for index, shape in enumerate(bench.shapes):
        color = f"C{index % 10}"
        timings = bench.timings.get(shape.kind)
        if timings:
            axes.plot([t["tokens"] for t in timings], [t["speedup"] for t in timings], marker="o", color=color,
                      label=f"{shape.kind} ({shape.out_features}x{shape.in_features}, TP {shape.tp}): GEMMs")
        whole = bench.linear_timings.get(shape.kind)
        if whole:
            axes.plot([t["tokens"] for t in whole], [t["speedup"] for t in whole], marker="s", linestyle=":",
                      color=color, label=f"{shape.kind}: whole linear")
    axes.axhline(bench.min_speedup, color="grey", linestyle="--", label=f"{bench.min_speedup:.2f}x: FP8 chosen above")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens (GEMM rows)")
    axes.set_ylabel("bf16 time / FP8 time")
    axes.set_title(f"FP8 speedup per layer kind, {bench.device} ({bench.preset}); dotted: the whole linear")
    axes.legend(fontsize=7)
    save_figure(figure, path, dpi=120)


def write_results(bench: GemmBench, output: Path) -> tuple[Path, Path]:
    """The policy (``output``, JSON) and the plot beside it (``.png``)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(bench.policy(), indent=2) + "\n")
    plot = output.with_suffix(".png")
    plot_speedups(bench, plot)
    return output, plot

