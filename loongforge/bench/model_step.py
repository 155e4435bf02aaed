"""``loongforge bench model``: forward + backward throughput and MFU of the model on one device,
next to transformers' class of the family (``ModelFamily.hf_model_class``: Qwen2.5-VL's
``Qwen2_5_VLForConditionalGeneration`` for the default preset) on the same tokens and images.

What is timed, per step: one forward and one backward of one micro-batch (no optimizer, no data
loading, no gradient sync), after ``warmup_steps`` untimed steps; on CUDA each step sits between
two CUDA events, on CPU between two ``perf_counter`` reads.

The micro-batch: ``samples`` samples of ``tokens / samples`` tokens each, sample ``i`` holding one
image of ``image_sizes[i % n]`` pixels (sized by the tower's image processing at the preset's
``data`` settings, ``TowerPart.images``; dropped when it does not fit its sample) between two halves of random text. Every token but
each sample's last carries loss, so the LM head runs on the same tokens in every variant. Because
the samples are of equal length, one packed row (``cu_seqlens``) and a batch of separate sequences
are the same work without padding:

- ``loongforge_packed``: the model as training runs it, one row of ``samples`` packed segments;
- ``loongforge_batch``: the same model on the batch ``[samples, tokens / samples]``;
- ``transformers_batch``: transformers (``attn_implementation="sdpa"``, random weights, same
  shapes and dtype; its inputs as the family's ``hf_model_inputs`` gives them) on that batch; it cannot pack without flash-attn, so it gets the batch form.
  Its LM head and loss run on every position (it has no loss-token selection), which equals
  ours here because every position but the last carries loss.

Model FLOPs are the family's ``training_flops`` (convention in ``models.flops``): the vision
encoder, the projector, the decoder with attention over each segment's full square, the LM head on
the loss tokens; MFU = FLOPs / step time / peak.
"""

from __future__ import annotations

import gc
import platform
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.balance.cost_model import SampleCost
from loongforge.calibrate.sweep import SweepSource
from loongforge.config.loader import load_run_config
from loongforge.config.errors import InputError
from loongforge.config.schema import RunConfig
from loongforge.models.flops import FlopOptions, StepFlops
from loongforge.models.media import MediaBatch
from loongforge.models.registry import get_family
from loongforge.parallel.distributed import init_distributed, init_model_parallel, resolve_device, shutdown
from loongforge.profile.features import sample_costs
from loongforge.train.runner import library_versions

# (width, height) in pixels: a square photo, 720p, a larger square and a portrait phone shot,
# so that image tokens are a realistic share (about a third at 8192 tokens) of the row.
DEFAULT_IMAGE_SIZES = ((448, 448), (1280, 720), (644, 644), (504, 896))
# Shortest text part a sample keeps beside its image.
MIN_TEXT_TOKENS = 16
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 dense tensor-core peak (TFLOP/s) by device name; MFU elsewhere needs --peak-tflops.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0}


@dataclass
class ModelBenchOptions:
    preset: str = "qwen2.5vl-7b"
    language_layers: Optional[int] = 4  # None: the preset's depth
    vision_blocks: Optional[int] = 8
    tokens: int = 8192
    samples: int = 4
    image_sizes: tuple = DEFAULT_IMAGE_SIZES
    steps: int = 10
    warmup_steps: int = 3
    device: str = "auto"
    dtype: str = "bf16"
    baseline: bool = True
    batch_variant: bool = True  # also time loongforge on the unpacked batch
    peak_tflops: Optional[float] = None
    seed: int = 0
    overrides: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Config and inputs
# ---------------------------------------------------------------------------------------------


def fullatt_within(indexes, depth: int) -> list[int]:
    """The full-attention blocks among the first ``depth`` (the real tower's first blocks); the
    last block when none falls inside, so a shortened tower still has one."""
    inside = [i for i in indexes if i < depth]
    return inside or [depth - 1]


def bench_overrides(opts: ModelBenchOptions, base: RunConfig) -> list[str]:
    """Overrides turning ``base`` (the preset) into the benchmarked single-device stack."""
    out = ["parallel.world_size=1", "parallel.tensor_model_parallel_size=1",
           "parallel.pipeline_model_parallel_size=1", "parallel.sequence_parallel=false",
           f"data.seq_len={opts.tokens}", f"training.precision={opts.dtype}",
           f"training.device={resolve_device(opts.device).type}"]
    if opts.language_layers is not None:
        out.append(f"model.language.num_layers={opts.language_layers}")
    if opts.vision_blocks is not None:
        out.append(f"model.vision.depth={opts.vision_blocks}")
        window = base.model.vision.window
        if window is not None:
            fullatt = fullatt_within(window.fullatt_block_indexes, opts.vision_blocks)
            out.append(f"model.vision.window.fullatt_block_indexes=[{','.join(map(str, fullatt))}]")
    return [*out, *opts.overrides]


def bench_run_config(opts: ModelBenchOptions) -> RunConfig:
    base = load_run_config(opts.preset, overrides=opts.overrides)
    return load_run_config(opts.preset, overrides=bench_overrides(opts, base), world_size=1)


def design_row(cfg: RunConfig, opts: ModelBenchOptions, source: SweepSource) -> list[tuple[int, list[tuple[int, int]]]]:
    """[(text tokens, [(height, width) image size in pixels]), ...]: ``samples`` samples of equal total length,
    each image as the family's processor plans it (``source``: the sweep's row builder)."""
    per_sample = opts.tokens // opts.samples
    if not opts.image_sizes or cfg.model.vision is None:
        return [(per_sample, [])] * opts.samples
    row = []
    for i in range(opts.samples):
        width, height = opts.image_sizes[i % len(opts.image_sizes)]
        image_tokens = source.image_tokens((height, width), 1)
        if image_tokens + MIN_TEXT_TOKENS > per_sample:
            row.append((per_sample, []))
        else:
            row.append((per_sample - image_tokens, [(height, width)]))
    return row


@dataclass
class BenchInputs:
    packed: dict  # data.collate contract: one row [1, T] with cu_seqlens
    batch: dict  # the same samples as [samples, T / samples], no packing
    segment_lengths: list[int]
    grids: list[tuple[int, int, int]]
    loss_tokens: int
    samples: list[SampleCost]  # what the model-FLOP count reads, per sample of the packed row

    @property
    def tokens(self) -> int:
        return sum(self.segment_lengths)


def _loss_on_every_token(micro_batch: dict) -> None:
    """Loss on every token but each sample's last (whose label crosses into the next sample)."""
    mask = torch.ones_like(micro_batch["loss_mask"])  # [1, T]
    ends = torch.as_tensor(micro_batch["cu_seqlens"][1:], dtype=torch.long) - 1
    mask[0, ends] = 0.0
    micro_batch["loss_mask"] = mask
    micro_batch["num_loss_tokens"] = int(mask.sum())


def build_inputs(cfg: RunConfig, opts: ModelBenchOptions) -> BenchInputs:
    # The profile sweep's row builder: random ids, M-RoPE positions, random pixels, collate keys.
    source = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=1)
    packed = source.micro_batch(0, design_row(cfg, opts, source))
    _loss_on_every_token(packed)
    n, length = opts.samples, packed["input_ids"].shape[1] // opts.samples
    batch = {
        "input_ids": packed["input_ids"].reshape(n, length),  # [n, Ls]
        "labels": packed["labels"].reshape(n, length),
        "loss_mask": packed["loss_mask"].reshape(n, length),
        "position_ids": packed["position_ids"].reshape(3, n, length),  # [3, n, Ls]
        "media": packed["media"],
    }
    image_grids = packed["media"].grids("image")
    grids = [] if image_grids is None else [tuple(g) for g in image_grids.tolist()]
    samples = sample_costs(packed)
    return BenchInputs(packed=packed, batch=batch, segment_lengths=list(packed["sample_lengths"]),
                       grids=grids, loss_tokens=packed["num_loss_tokens"], samples=samples)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_steps(step: Callable[[], None], device: torch.device, *, steps: int, warmup_steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup_steps`` untimed ones."""
    for _ in range(warmup_steps):
        step()
    if device.type != "cuda":
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        return seconds
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()  # one wait for all steps: the host keeps queueing ahead
    return [start.elapsed_time(end) / 1000.0 for start, end in events]


def _to(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, (torch.Tensor, MediaBatch)) else v for k, v in inputs.items()}


def packed_seq_params(cu_seqlens: torch.Tensor):
    """thd ``PackedSeqParams`` over ``cu_seqlens`` [segments + 1], as the training step builds them."""
    cu = cu_seqlens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def loongforge_step(model, inputs: dict, *, packed: bool) -> Callable[[], None]:
    """One forward + backward of the megatron-core model on ``inputs`` (already on device)."""
    params = packed_seq_params(inputs["cu_seqlens"]) if packed else None

    def step() -> None:
        model.zero_grad(set_to_none=True)
        per_token = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                          labels=inputs["labels"], loss_mask=inputs["loss_mask"],
                          packed_seq_params=params, media=inputs["media"])  # [b, s] fp32
        mask = inputs["loss_mask"]
        ((per_token * mask).sum() / mask.sum()).backward()

    return step


def transformers_step(model, inputs: dict) -> Callable[[], None]:
    """One forward + backward of transformers' model on its forward's ``inputs``
    (``transformers_inputs``); it shifts ``labels`` itself."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()

    return step


def transformers_inputs(cfg: RunConfig, batch: dict) -> dict:
    """The batch as the family's transformers class takes it (``ModelFamily.hf_model_inputs``), with
    the same rotary positions as ours (a 1-D RoPE family's first row: [n, L])."""
    family = get_family(cfg.model.family)
    positions = batch["position_ids"] if family.rope == "mrope" else batch["position_ids"][0]
    return {**family.hf_model_inputs(cfg.model, batch), "position_ids": positions}


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def build_loongforge_model(cfg: RunConfig, device: torch.device):
    return get_family(cfg.model.family).build(
        cfg.model, cfg.parallel, params_dtype=_DTYPES[cfg.training.precision], pre_process=True,
        post_process=True, device=device).train()


def build_transformers_model(cfg: RunConfig, device: torch.device):
    """The family's transformers class (``ModelFamily.hf_model_class``) with the same shapes, random
    weights, SDPA attention."""
    import transformers  # lazy: transformers (~1.5 s) only for the transformers baseline

    family = get_family(cfg.model.family)
    hf_cfg = transformers.AutoConfig.for_model(**family.config_to_hf(cfg.model))
    model_class = getattr(transformers, family.hf_model_class)
    # An Auto class builds the config's own class; a model class builds itself.
    build = model_class.from_config if model_class.__name__.startswith("Auto") else model_class._from_config
    with torch.device(device):  # initialise on the device: seconds instead of minutes at 7B widths
        model = build(hf_cfg, attn_implementation="sdpa", dtype=_DTYPES[cfg.training.precision])
    return model.train()


def check_baseline(cfg: RunConfig, opts: ModelBenchOptions) -> None:
    """A transformers baseline needs a family with a transformers class; an InputError otherwise."""
    family = get_family(cfg.model.family)
    if opts.baseline and family.hf_model_class is None:
        raise InputError(f"{opts.preset}: model.family={family.name} has no transformers class to compare "
                         "with; run with --no-baseline")


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _measure(name: str, step: Callable[[], None], device: torch.device, opts: ModelBenchOptions,
             flops: StepFlops, tokens: int, peak_flops: Optional[float], what: str) -> dict:
    seconds = sorted(time_steps(step, device, steps=opts.steps, warmup_steps=opts.warmup_steps))
    median = seconds[len(seconds) // 2]
    achieved = flops.total / median
    return {"name": name, "what": what, "step_s_median": median, "step_s_min": seconds[0],
            "step_s_max": seconds[-1], "tokens_per_s": tokens / median,
            "achieved_tflops": achieved / 1e12,
            "mfu": None if peak_flops is None else achieved / peak_flops,
            "peak_memory_gib": _peak_memory_gib(device)}


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def peak_tflops_for(device: torch.device, dtype: str, explicit: Optional[float]) -> tuple[Optional[float], str]:
    """(peak TFLOP/s, where it came from); None when unknown (MFU is then not reported)."""
    if explicit is not None:
        return explicit, "--peak-tflops"
    if device.type == "cuda" and dtype == "bf16":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16_TFLOPS.items():
            if key in name:
                return value, f"{key} bf16 dense"
    return None, "not known for this device and dtype (pass --peak-tflops)"


def environment(device: torch.device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            (platform.processor() or platform.machine()), "device_type": device.type,
            "torch_threads": torch.get_num_threads(), "versions": library_versions()}


def describe_stack(cfg: RunConfig, inputs: BenchInputs) -> dict:
    vis, lang = cfg.model.vision, cfg.model.language
    patches = sum(t * h * w for t, h, w in inputs.grids)
    return {"language_layers": lang.num_layers, "hidden_size": lang.hidden_size,
            "ffn_hidden_size": lang.ffn_hidden_size, "vocab_size": lang.vocab_size,
            "vision_blocks": vis.depth, "vision_hidden_size": vis.hidden_size,
            "fullatt_block_indexes": list(vis.window.fullatt_block_indexes) if vis.window else [],
            "tokens": inputs.tokens, "samples": len(inputs.segment_lengths),
            "segment_lengths": inputs.segment_lengths, "image_grids_thw": [list(g) for g in inputs.grids],
            "image_tokens": patches // cfg.model.projector.spatial_merge_size ** 2, "patches": patches,
            "loss_tokens": inputs.loss_tokens}


def run_model_bench(opts: ModelBenchOptions, log: Callable[[str], None] = lambda _: None) -> dict:
    """Time every variant; returns the result dict (``format_markdown`` renders it)."""
    if opts.tokens % opts.samples:
        raise ValueError(f"--tokens {opts.tokens} must be a multiple of --samples {opts.samples}")
    cfg = bench_run_config(opts)
    check_baseline(cfg, opts)
    device = resolve_device(opts.device)
    env = init_distributed(device.type)
    try:
        init_model_parallel(cfg.parallel, seed=opts.seed, device=env.device)
        return _run(cfg, opts, env.device, log)
    finally:
        shutdown(env)


def _run(cfg: RunConfig, opts: ModelBenchOptions, device: torch.device, log) -> dict:
    torch.manual_seed(opts.seed)
    inputs = build_inputs(cfg, opts)
    # The bench's model has no frozen tower and no recompute (build_loongforge_model): default options.
    flops = get_family(cfg.model.family).training_flops(cfg.model, inputs.samples, FlopOptions())
    peak, peak_source = peak_tflops_for(device, opts.dtype, opts.peak_tflops)
    peak_flops = None if peak is None else peak * 1e12
    packed, batch = _to(inputs.packed, device), _to(inputs.batch, device)
    def measure(name: str, step: Callable[[], None], what: str) -> dict:
        log(f"timing {name}: {opts.warmup_steps} warm-up + {opts.steps} steps")
        return _measure(name, step, device, opts, flops, inputs.tokens, peak_flops, what)

    runs = []
    log("building the loongforge model")
    model = build_loongforge_model(cfg, device)
    runs.append(measure("loongforge_packed", loongforge_step(model, packed, packed=True),
                        f"one packed row of {len(inputs.segment_lengths)} segments (cu_seqlens)"))
    if opts.batch_variant:
        runs.append(measure("loongforge_batch", loongforge_step(model, batch, packed=False),
                            f"batch [{len(inputs.segment_lengths)}, {inputs.tokens // opts.samples}]"))
    del model
    _release(device)
    if opts.baseline:
        log("building the transformers model")
        hf_model = build_transformers_model(cfg, device)
        runs.append(measure("transformers_batch", transformers_step(hf_model, transformers_inputs(cfg, batch)),
                            f"batch [{len(inputs.segment_lengths)}, {inputs.tokens // opts.samples}], "
                            "sdpa, LM head and loss on every position"))
        del hf_model
        _release(device)
    return {"preset": cfg.preset, "dtype": opts.dtype, "steps": opts.steps,
            "warmup_steps": opts.warmup_steps, "stack": describe_stack(cfg, inputs),
            "flops_per_step": flops.to_dict(), "peak_tflops": peak, "peak_source": peak_source,
            "runs": runs, "ratios": _ratios(runs), "environment": environment(device)}


def _ratios(runs: list[dict]) -> dict:
    """Throughput ratios loongforge / transformers (> 1: loongforge faster)."""
    by_name = {r["name"]: r["tokens_per_s"] for r in runs}
    base = by_name.get("transformers_batch")
    if base is None:
        return {}
    return {f"{name}/transformers_batch": value / base for name, value in by_name.items()
            if name != "transformers_batch"}


def _flop_text(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def format_markdown(result: dict) -> str:
    stack, flops = result["stack"], result["flops_per_step"]
    lines = [
        f"{result['preset']}-shaped stack, {result['dtype']}: {stack['language_layers']} language layers "
        f"(hidden {stack['hidden_size']}), {stack['vision_blocks']} vision blocks (full attention in "
        f"{stack['fullatt_block_indexes']}); {stack['tokens']} tokens in {stack['samples']} samples "
        f"of {stack['segment_lengths'][0]}, {stack['image_tokens']} image tokens from grids "
        f"{stack['image_grids_thw']}; loss on {stack['loss_tokens']} tokens.",
        f"Model FLOPs per step (forward+backward): {_flop_text(flops['total'])} (vision "
        f"{_flop_text(flops['vision'])}, projector {_flop_text(flops['projector'])}, language "
        f"{_flop_text(flops['language'])}, LM head {_flop_text(flops['lm_head'])}); peak "
        + (f"{result['peak_tflops']:.0f} TFLOP/s ({result['peak_source']})." if result["peak_tflops"]
           else f"{result['peak_source']}."),
        f"Median of {result['steps']} steps after {result['warmup_steps']} warm-up steps; device "
        f"{result['environment']['device']}.", "",
        "| variant | input | step (ms) | tokens/s | TFLOP/s | MFU | peak mem (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
        mem = "n/a" if run["peak_memory_gib"] is None else f"{run['peak_memory_gib']:.1f}"
        lines.append(f"| {run['name']} | {run['what']} | {1000 * run['step_s_median']:.1f} | "
                     f"{run['tokens_per_s']:,.0f} | {run['achieved_tflops']:.3g} | {mfu} | {mem} |")
    if result["ratios"]:
        lines += ["", "Throughput ratio (loongforge / transformers): " + ", ".join(
            f"{name} {value:.2f}x" for name, value in result["ratios"].items())]
    return "\n".join(lines) + "\n"
