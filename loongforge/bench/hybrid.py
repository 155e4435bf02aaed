"""``loongforge bench hybrid``: how a hybrid linear-attention decoder's step grows with the sequence, beside
the same model with every layer full attention, in one run.

Each variant is the preset's decoder (the vision tower is not built: text rows only) at ``--layers`` layers:

- ``hybrid``: the preset's own ``layer_types`` (Qwen3.5: three Gated DeltaNet layers, then a gated attention
  one), cycled over the layers;
- ``all_attention``: the same widths with every layer gated full attention (``layer_types`` all
  ``full_attention``, no linear layers);
- ``all_linear``: every layer Gated DeltaNet: the linear layers' own growth, which in a small model the
  hybrid's one attention layer hides beyond a few thousand tokens (its square overtakes the linear
  layers' per-token work there: ``calibrate.fit_cost.flops_crossover_length``).

At each sequence length one packed row holds one sample of that many tokens (the causal square is the
whole row's: the worst case for attention, the usual one for long-context training). Timed per step: one
forward and one backward (no optimizer), after warm-up steps; on CUDA between CUDA events. Memory, per
step: the bytes autograd saves for the backward (every tensor a saved-tensor hook sees, counted once per
storage: activation memory, on any device), and on CUDA the allocator's peak too. FLOPs are the family's
``training_flops`` (``models.flops``): linear-attention layers linear in L, attention's square in L.
"""

from __future__ import annotations

import dataclasses
import gc
import platform
from dataclasses import dataclass, field
from typing import Callable

import torch

from loongforge.balance.cost_model import SampleCost
from loongforge.bench.model_step import packed_seq_params, time_steps
from loongforge.config.errors import ConfigError
from loongforge.config.loader import load_run_config
from loongforge.config.schema import RunConfig
from loongforge.models.flops import FlopOptions
from loongforge.models.registry import get_family
from loongforge.parallel.distributed import init_distributed, init_model_parallel, resolve_device, shutdown
from loongforge.train.runner import library_versions

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("hybrid", "all_attention", "all_linear")
_EVERY_LAYER = {"all_attention": "full_attention", "all_linear": "linear_attention"}


@dataclass
class HybridBenchOptions:
    # The small vocabulary: at 32k tokens a 152k-entry LM head alone would keep 20 GB of logits for backward.
    preset: str = "qwen3.5-tiny-small-vocab"
    seq_lens: list[int] = field(default_factory=lambda: [2048, 8192, 32768])
    layers: int = 4
    steps: int = 3
    warmup_steps: int = 1
    device: str = "auto"
    dtype: str = "fp32"
    seed: int = 0


def variant_config(opts: HybridBenchOptions, variant: str) -> RunConfig:
    """The preset at ``opts.layers`` layers: its own layer pattern cycled (``hybrid``), or all attention."""
    base = load_run_config(opts.preset).model.language
    if not base.layer_types:
        raise ConfigError(f"--preset {opts.preset}: model.language.layer_types is empty; bench hybrid compares a "
                         "hybrid decoder with its all-attention twin (e.g. --preset qwen3.5-tiny)")
    pattern = [base.layer_types[i % len(base.layer_types)] for i in range(opts.layers)]
    if variant != "hybrid":
        pattern = [_EVERY_LAYER[variant]] * opts.layers
    linear = "linear_attention" in pattern
    overrides = [f"model.language.num_layers={opts.layers}", f"model.language.layer_types=[{','.join(pattern)}]",
                 f"training.precision={opts.dtype}", f"data.seq_len={max(opts.seq_lens)}",
                 "model.language.max_position_embeddings=" + str(max(262_144, max(opts.seq_lens)))]
    if not linear:
        overrides.append("model.language.linear_attention=null")
    return load_run_config(opts.preset, overrides=overrides)


def _row(cfg: RunConfig, length: int, device: torch.device, generator: torch.Generator) -> dict:
    """One packed row of one text sample: ids, M-RoPE positions (text: the three axes alike), labels."""
    tokens = cfg.model.tokens  # text ids only: below the vocabulary's special (vision) tokens
    text_ids = min(cfg.model.language.vocab_size, tokens.image_token_id, tokens.video_token_id,
                   tokens.vision_start_token_id, tokens.vision_end_token_id)
    ids = torch.randint(0, text_ids, (1, length), generator=generator)
    positions = torch.arange(length).view(1, 1, -1).expand(3, 1, -1)
    return {"input_ids": ids.to(device), "position_ids": positions.contiguous().to(device),
            "labels": torch.roll(ids, -1, dims=1).to(device), "loss_mask": torch.ones(1, length, device=device),
            "packed": packed_seq_params(torch.tensor([0, length]).to(device))}


def saved_bytes(step: Callable[[], None]) -> int:
    """Bytes autograd keeps for the backward during one ``step`` (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(storages.values())


def _measure(cfg: RunConfig, length: int, opts: HybridBenchOptions, device: torch.device) -> dict:
    family = get_family(cfg.model.family)
    model = family.build(cfg.model, cfg.parallel, params_dtype=_DTYPES[opts.dtype], pre_process=True,
                         post_process=True, device=device, with_encoder=False).train()
    row = _row(cfg, length, device, torch.Generator().manual_seed(opts.seed))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        per_token = model(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"],
                          loss_mask=row["loss_mask"], packed_seq_params=row["packed"])
        per_token.sum().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    saved = saved_bytes(step)  # the first warm-up step, counted (an extra step when there is none)
    seconds = sorted(time_steps(step, device, steps=opts.steps, warmup_steps=max(0, opts.warmup_steps - 1)))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    flops = family.training_flops(cfg.model, [SampleCost(tokens=length, loss_tokens=length)], FlopOptions())
    return {"seq_len": length, "step_s_median": seconds[len(seconds) // 2], "step_s_min": seconds[0],
            "saved_for_backward_gib": saved / 2**30, "peak_memory_gib": peak, "model_tflop": flops.total / 1e12}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_hybrid_bench(opts: HybridBenchOptions, log: Callable[[str], None] = lambda _: None) -> dict:
    """Every (variant, sequence length); the result dict ``format_markdown`` renders."""
    device = resolve_device(opts.device)
    configs = {variant: variant_config(opts, variant) for variant in VARIANTS}
    env = init_distributed(device.type)
    try:
        init_model_parallel(configs["hybrid"].parallel, seed=opts.seed, device=env.device)
        rows = []
        for length in opts.seq_lens:
            for variant in VARIANTS:
                log(f"{variant} at {length:,} tokens")
                rows.append({"variant": variant, **_measure(configs[variant], length, opts, env.device)})
                _release(env.device)  # the model of the point just measured
    finally:
        shutdown(env)
    return {"options": dataclasses.asdict(opts), "device": str(device),
            "environment": {"platform": platform.platform(), **library_versions()},
            "layer_types": {variant: list(cfg.model.language.layer_types) for variant, cfg in configs.items()},
            "rows": rows, "growth": growth(rows)}


def growth(rows: list[dict]) -> dict:
    """Per variant, each length's step time and saved bytes over the shortest length's, and the ratio of
    the lengths: a cost linear in L grows like the lengths, a quadratic one like their square."""
    out = {}
    for variant in VARIANTS:
        mine = sorted((row for row in rows if row["variant"] == variant), key=lambda row: row["seq_len"])
        first = mine[0]
        out[variant] = [{"seq_len": row["seq_len"], "length_ratio": row["seq_len"] / first["seq_len"],
                         "time_ratio": row["step_s_median"] / first["step_s_median"],
                         "saved_ratio": row["saved_for_backward_gib"] / first["saved_for_backward_gib"]}
                        for row in mine]
    return out


def format_markdown(result: dict) -> str:
    rows = {(row["variant"], row["seq_len"]): row for row in result["rows"]}
    lengths = sorted({row["seq_len"] for row in result["rows"]})
    ratios = {(variant, g["seq_len"]): g for variant, entries in result["growth"].items() for g in entries}
    lines = [f"Device: {result['device']}, {result['options']['dtype']}, {result['options']['layers']} layers; "
             f"hybrid layers: {', '.join(result['layer_types']['hybrid'])}", "",
             "| tokens | variant | step s (median) | x shortest | saved for backward GiB | x shortest | "
             "model TFLOP | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        for variant in VARIANTS:
            row, ratio = rows[variant, length], ratios[variant, length]
            peak = "n/a" if row["peak_memory_gib"] is None else f"{row['peak_memory_gib']:.2f}"
            lines.append(f"| {length:,} | {variant} | {row['step_s_median']:.3f} | {ratio['time_ratio']:.1f} | "
                         f"{row['saved_for_backward_gib']:.3f} | {ratio['saved_ratio']:.1f} | "
                         f"{row['model_tflop']:.3f} | {peak} |")
    longest = lengths[-1]
    speedup = rows["all_attention", longest]["step_s_median"] / rows["hybrid", longest]["step_s_median"]
    lines += ["", f"At {longest:,} tokens the hybrid step takes {1 / speedup:.2f}x all attention's time; from "
              f"{lengths[0]:,} to {longest:,} tokens ({longest / lengths[0]:.0f}x) the step time grows "
              f"{ratios['hybrid', longest]['time_ratio']:.1f}x (hybrid), "
              f"{ratios['all_attention', longest]['time_ratio']:.1f}x (all attention), "
              f"{ratios['all_linear', longest]['time_ratio']:.1f}x (all linear)."]
    return "\n".join(lines) + "\n"
