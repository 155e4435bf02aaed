"""The Python half of ``scripts/gpu_check.sh``: the logits-parity step, the per-step checks and the
report. Run by the shell script, one subcommand per call; every check prints one PASS/FAIL line
with its figures and writes ``<work>/<step>.status.json`` for the report.

  python scripts/gpu_check.py overrides --preset P --tokens N ...   # the bench's overrides, one a line
  python scripts/gpu_check.py parity --device cuda --output R.json  # step b
  python scripts/gpu_check.py varlen --device cuda --output R.json  # step i
  python scripts/gpu_check.py compile --device cuda --output R.json  # step j
  python scripts/gpu_check.py check STEP --work DIR --rc RC --seconds S [step options]
  python scripts/gpu_check.py report --work DIR --output gpu.md [--mode gpu|cpu-rehearsal]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Step names in run order; the shell script uses the same names for its logs.
STEPS = ("a_train", "b_parity", "c_bench", "d_pytest", "e_cost", "f_moe", "g_fp8", "h_hybrid", "i_varlen", "j_compile")
TITLES = {"a_train": "a. train qwen2.5vl-tiny, save, resume",
          "b_parity": "b. the run's process group (an all-reduce of a CPU and a device tensor), logits parity vs "
                      "transformers (fp32)",
          "c_bench": "c. bench model: forward+backward tokens/s, MFU, vs transformers",
          "d_pytest": "d. CPU test suite (fast part) on the GPU machine",
          "e_cost": "e. profile --sweep + fit-cost (CUDA-event timing)",
          "f_moe": "f. train qwen3-moe-tiny (MoE layer, all-to-all dispatcher), bench moe: grouped vs sequential experts",
          "g_fp8": "g. FP8: bench gemm policies, bf16 vs fp8-auto training",
          "h_hybrid": "h. Qwen3.5: the device's gated delta rule vs the token-by-token rule, train qwen3.5-tiny, "
                      "bench hybrid",
          "i_varlen": "i. packed attention: torch's varlen kernel vs SDPA per segment (forward+backward)",
          "j_compile": "j. training.compile: each compiled part (norm, rope, SwiGLU, MoE permute) vs eager "
                        "(forward+backward)"}
# The device's gated delta rule (fla's Triton kernel on CUDA, whose fp32 dots may run in TF32) against the
# token-by-token rule in fp32, relative to the largest output / gradient.
RULE_TOLERANCE = 5e-3
RULE_LENGTHS = (37, 300, 1000)  # a packed row: a short sample, chunk boundaries inside the others
PARITY_TOLERANCE = 1e-4
# Grouped vs sequential experts' outputs relative to the largest (bf16 on CUDA: the two sum in different
# orders, each output rounded to bf16's 8 bits, 3.9e-3 apart at most per rounding).
MOE_OUTPUT_TOLERANCE = 2e-2
# Step i: one packed row of attention, Qwen2.5-7B's shape (28 query heads, 4 KV groups, head dim 128) on the
# GPU, a toy one in the rehearsal; sample lengths as a packed row mixes them (the last fills the row).
VARLEN_SHAPES = {"cuda": (8192, 28, 4, 128), "cpu": (512, 4, 2, 32)}  # (tokens, heads, groups, head dim)
VARLEN_LENGTHS = (37, 300, 1000, 2048, 513, 64, 1500, 900, 128)
VARLEN_TOLERANCE = 2e-2  # bf16 kernels vs fp32 SDPA, relative to the largest output / gradient
# Step j: row lengths (tokens) the compiled parts are timed at; Qwen2.5-7B's block shapes on the GPU
# (bench.compile_parts.GPU_SHAPE), toy ones in the rehearsal. Compiled vs eager, each against eager in fp64:
# bf16 rounding on the GPU, fp32's on the CPU.
COMPILE_TOKENS = {"cuda": (1024, 8192), "cpu": (64,)}
COMPILE_TOLERANCE = {"cuda": 2e-2, "cpu": 5e-6}
# Layouts of the parity samples: (t, h, w) patch grids of images and videos.
PARITY_CASES = {"text": {}, "image": {"images": ((1, 8, 12),)},
                "two_images": {"images": ((1, 8, 12), (1, 20, 16))}, "video": {"videos": ((2, 8, 8),)}}


# ---------------------------------------------------------------------------------------------
# overrides: the benchmark stack, shared by steps c and e
# ---------------------------------------------------------------------------------------------


def cmd_overrides(args) -> int:
    from loongforge.bench.model_step import ModelBenchOptions, bench_overrides
    from loongforge.config.loader import load_run_config

    opts = ModelBenchOptions(preset=args.preset, language_layers=args.language_layers or None,
                             vision_blocks=args.vision_blocks or None, tokens=args.tokens,
                             device=args.device, dtype=args.dtype)
    for item in bench_overrides(opts, load_run_config(args.preset)):
        print(item)
    return 0


# ---------------------------------------------------------------------------------------------
# parity (step b)
# ---------------------------------------------------------------------------------------------


def _on(sample, device):
    """A copy of a tests.models.helpers.Sample with every tensor on ``device``."""
    return dataclasses.replace(sample, **{f.name: getattr(sample, f.name).to(device)
                                          for f in dataclasses.fields(sample)
                                          if getattr(sample, f.name) is not None})


def _parity_models(device):
    import torch

    from loongforge.config.schema import ParallelConfig
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.registry import get_family
    from tests.models.helpers import build_hf_model, tiny_model_cfg

    model_cfg = tiny_model_cfg(tie=False)  # sdpa layers: the numerical reference backend
    hf_model = build_hf_model(model_cfg)  # random fp32, every tensor randomised
    model = get_family(model_cfg.family).build(model_cfg, ParallelConfig(), params_dtype=torch.float32,
                                          pre_process=True, post_process=True, device=device).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model.to(device), model


def _parity_diffs(device) -> dict:
    import torch

    from tests.models.helpers import hf_logits, hf_position_ids, make_sample, our_inputs

    model_cfg, hf_model, model = _parity_models(device)
    diffs = {}
    for name, layout in PARITY_CASES.items():
        sample = _on(make_sample(model_cfg, **layout), device)
        reference = hf_logits(hf_model, sample)  # [1, s, V]
        with torch.no_grad():
            logits = model(**our_inputs(sample, hf_position_ids(hf_model, sample)))  # [1, s, V_padded]
        diffs[name] = float((logits[..., :reference.shape[-1]].float() - reference.float()).abs().max())
    return diffs


def _collectives(env) -> dict:
    """An all-reduce of a CPU tensor and of one on the run's device through the default group the
    training run makes (``init_distributed``): a CUDA run's group must carry both (gloo for the CPU
    bookkeeping, NCCL for CUDA tensors), which an NCCL-only group fails even at world size 1.
    {device type: "ok" or the error}."""
    import torch
    import torch.distributed as dist

    results = {}
    for device in dict.fromkeys(["cpu", env.device.type]):
        try:
            tensor = torch.full((4,), 2.0, device=env.device if device != "cpu" else "cpu")
            dist.all_reduce(tensor)
            expected = 2.0 * dist.get_world_size()
            results[device] = "ok" if bool((tensor == expected).all()) else f"sum {tensor.tolist()} != {expected}"
        except Exception as exc:  # the check's point: any failure is this step's FAIL line
            results[device] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return results


def cmd_linear_attention(args) -> int:
    """The rule ``layer_backend.linear_attention_rule`` picks on the device vs ``linear_attention.recurrent``
    on a packed row of three samples (key heads serving two value heads each): outputs and the q, k, v
    gradients, relative to the largest of each."""
    import torch

    from loongforge.models.decoder import linear_attention
    from loongforge.models.layers.layer_backend import linear_attention_rule

    device = torch.device(args.device)
    rule = linear_attention_rule(device)
    generator = torch.Generator().manual_seed(0)
    total = sum(RULE_LENGTHS)
    q, k = (torch.randn(total, 4, 64, generator=generator) for _ in range(2))
    v = torch.randn(total, 8, 64, generator=generator)
    g = -torch.rand(total, 8, generator=generator)
    beta = torch.rand(total, 8, generator=generator)
    cu_seqlens = torch.tensor([0, *RULE_LENGTHS]).cumsum(0).to(torch.int32)

    def run(function, where):
        leaves = [x.detach().clone().to(where).requires_grad_() for x in (q, k, v)]
        out = function(*leaves, g.to(where), beta.to(where), cu_seqlens.to(where))
        out.backward(torch.ones_like(out))
        return [out.detach().cpu().float()] + [x.grad.cpu().float() for x in leaves]

    ours, reference = run(rule, device), run(linear_attention.recurrent, "cpu")
    diffs = {name: float((a - b).abs().max() / b.abs().max())
             for name, a, b in zip(("out", "dq", "dk", "dv"), ours, reference)}
    result = {"device": str(device), "rule": "fla" if rule is linear_attention.fla_chunked else "torch",
              "lengths": list(RULE_LENGTHS), "tolerance": RULE_TOLERANCE, "relative_diff": diffs}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def _varlen_row(tokens: int) -> list[int]:
    """Sample lengths of one packed row of ``tokens``: VARLEN_LENGTHS cut to fit, the last filling it."""
    lengths, used = [], 0
    for length in VARLEN_LENGTHS:
        if used + length >= tokens:
            break
        lengths.append(length)
        used += length
    return lengths + [tokens - used]


def cmd_varlen(args) -> int:
    """Step i: the varlen layer backend's attention (torch's varlen kernel, bf16) against SDPA per segment
    on one packed row, forward and backward: outputs and q, k, v gradients relative to fp32 SDPA's
    largest, and the milliseconds of each in the row's dtype. Where varlen cannot run (the CPU
    rehearsal) SDPA's time alone, with the reason."""
    import time

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge.models.layers import attention
    from loongforge.models.layers.layer_backend import resolve_layer_backend

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens, heads, groups, head_dim = VARLEN_SHAPES[device.type]
    lengths = _varlen_row(tokens)
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(tokens, n, head_dim, generator=generator) for n in (heads, groups, groups)]
    grad = torch.randn(tokens, heads * head_dim, generator=generator)

    def run(module, as_dtype):
        leaves = [x.to(device, as_dtype).requires_grad_() for x in inputs]
        out = module(*leaves, None, packed_seq_params=params)
        out.backward(grad.to(device, as_dtype))
        return [out.detach().float().cpu()] + [x.grad.float().cpu() for x in leaves]

    def milliseconds(module) -> float:
        for _ in range(args.warmup_steps):
            run(module, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            run(module, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / args.steps

    sdpa = attention.SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
              "segments": len(lengths), "heads": heads, "groups": groups, "head_dim": head_dim,
              "tolerance": VARLEN_TOLERANCE, "sdpa_ms": milliseconds(sdpa)}
    backend = resolve_layer_backend("auto", device, dtype)
    result["auto_backend"] = backend
    try:
        resolve_layer_backend("varlen", device, dtype)
    except Exception as exc:  # noqa: BLE001 - why varlen cannot run here is the figure
        result["varlen"] = f"not run: {exc}"
    else:
        varlen = attention.VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")
        reference = run(sdpa, torch.float32)
        ours = run(varlen, dtype)
        result["relative_diff"] = {name: float((a - b).abs().max() / b.abs().max())
                                   for name, a, b in zip(("out", "dq", "dk", "dv"), ours, reference)}
        result["varlen_ms"] = milliseconds(varlen)
        result["speedup"] = result["sdpa_ms"] / result["varlen_ms"]
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def cmd_compile(args) -> int:
    """Step j: each part of ``training.compile`` (``bench.compile_parts``) compiled against eager at the row
    lengths of ``COMPILE_TOKENS``: milliseconds of forward + backward, the first call's seconds (compiling), and
    both against eager in float64. The parts whose compiled time beats eager at the longest row are what the
    measured default should compile."""
    import torch

    from loongforge.bench import compile_parts
    from loongforge.models.layers.compiled import compile_parts as auto_parts

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = compile_parts.GPU_SHAPE if device.type == "cuda" else compile_parts.Shape()
    results = [compile_parts.measure(part, tokens, shape, device, dtype, repeats=args.steps)
               for part in args.parts.split(",") for tokens in COMPILE_TOKENS[device.type]]
    for result in results:
        print(compile_parts.line(result), flush=True)
    record = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "tolerance":
              COMPILE_TOLERANCE[device.type], "auto": list(auto_parts("auto", device)), "results": results}
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def cmd_parity(args) -> int:
    import torch

    from loongforge.config.schema import ParallelConfig
    from loongforge.parallel.distributed import init_distributed, init_model_parallel, shutdown

    # fp32 means fp32: TF32 matmuls would differ from the reference by ~1e-3.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    env = init_distributed(args.device)
    try:
        collectives = _collectives(env)
        init_model_parallel(ParallelConfig(), seed=0, device=env.device)
        diffs = _parity_diffs(env.device)
    finally:
        shutdown()
    result = {"device": str(env.device), "backend": env.backend, "collectives": collectives,
              "tolerance": PARITY_TOLERANCE, "max_abs_diff": diffs}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# checks: one per step, each returns (passed, figures, summary line)
# ---------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _loss_trend(records: list[dict]) -> tuple[list[int], list[float], int, float, float]:
    """(steps, losses, window, mean loss of the first window, of the last): the window is a quarter
    of the run, 1 to 5 steps."""
    steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
    window = max(1, min(5, len(losses) // 4))
    return steps, losses, window, sum(losses[:window]) / window, sum(losses[-window:]) / window


def check_train(work: Path, args) -> tuple[bool, dict, str]:
    steps, losses, window, first, last = _loss_trend(_read_jsonl(work / "train" / "metrics.jsonl"))
    log = (work / "a_train.log").read_text(errors="replace")
    resumed = f"at step {args.exit_at}" in log and "resumed from" in log
    figures = {"steps": len(steps), "loss_first": first, "loss_last": last, "window": window,
               "resumed_at": args.exit_at if resumed else None}
    ok = (steps == list(range(1, args.steps + 1)) and resumed and all(map(math.isfinite, losses))
          and last < args.max_loss_ratio * first)
    return ok, figures, (f"steps 1-{steps[-1] if steps else 0} ({len(steps)} logged), resumed at "
                         f"{figures['resumed_at']}, loss {first:.3f} (first {window}) -> {last:.3f} "
                         f"(last {window}), must fall below {args.max_loss_ratio:.2f}x")


def check_parity(work: Path, args) -> tuple[bool, dict, str]:
    result = json.loads((work / "b_parity.result.json").read_text())
    worst = max(result["max_abs_diff"].values())
    collectives = result["collectives"]
    ok = worst <= result["tolerance"] and all(outcome == "ok" for outcome in collectives.values())
    cases = ", ".join(f"{k} {v:.2e}" for k, v in result["max_abs_diff"].items())
    reduces = ", ".join(f"{device} {outcome}" for device, outcome in collectives.items())
    return ok, result, (f"{result['backend']} group all-reduces: {reduces}; max |logits diff| {worst:.2e} "
                        f"(tolerance {result['tolerance']:.0e}) on {result['device']}: {cases}")


def check_bench(work: Path, args) -> tuple[bool, dict, str]:
    result = json.loads((work / "c_bench.result.json").read_text())
    runs = {r["name"]: r for r in result["runs"]}
    ok = "loongforge_packed" in runs and all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
                                             for r in runs.values())
    if args.require_baseline:
        ok = ok and "transformers_batch" in runs

    def mfu(run):
        return "n/a" if run.get("mfu") is None else f"{100 * run['mfu']:.1f}%"

    parts = [f"{name} {r['tokens_per_s']:,.0f} tok/s MFU {mfu(r)}" for name, r in runs.items()]
    parts += [f"{name} {value:.2f}x" for name, value in result["ratios"].items()]
    return ok, result, "; ".join(parts)


def check_pytest(work: Path, args) -> tuple[bool, dict, str]:
    import re

    log = (work / "d_pytest.log").read_text(errors="replace")
    summary = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    last = summary[-1].strip("= ") if summary else "no pytest summary line"
    # One line per failed test from the step's plugin (scripts/gpu_check_failures.py), also when cut off.
    failed = sorted({line.split(" ", 2)[1] for line in log.splitlines() if line.startswith("FAILED ")})
    if failed:
        last += f"; failed: {', '.join(failed[:12])}" + (f" and {len(failed) - 12} more" if len(failed) > 12 else "")
    return args.rc == 0, {"summary": last, "failed": failed}, last


def check_cost(work: Path, args) -> tuple[bool, dict, str]:
    cost = json.loads((work / "e_cost.json").read_text())
    accuracy = cost["accuracy"]
    held = accuracy["held_out_micro_batch"]
    cv = accuracy.get("comparison", {}).get("nnls", {}).get("cross_validated", {}).get("micro_batch", {})
    median = held.get("median_ape_pct")
    env = cost.get("environment", {})
    figures = {"held_out_median_ape_pct": median, "held_out_p90_ape_pct": held.get("p90_ape_pct"),
               "cross_validated_median_ape_pct": cv.get("median_ape_pct"), "target_pct": args.target,
               "observations": accuracy.get("observations"), "device": env.get("device")}
    enforced = args.target is not None
    ok = median is not None and (not enforced or median <= args.target)
    target = f"target <= {args.target:.0f}%" if enforced else "target 5% not enforced in the rehearsal"
    cv_text = "n/a" if cv.get("median_ape_pct") is None else f"{cv['median_ape_pct']:.2f}%"
    return ok, figures, (f"held-out per-micro-batch median error {median:.2f}% (p90 "
                         f"{held.get('p90_ape_pct', float('nan')):.2f}%, 4-fold {cv_text}; {target}) "
                         f"on {env.get('device')}")


def check_moe(work: Path, args) -> tuple[bool, dict, str]:
    records = _read_jsonl(work / "moe" / "metrics.jsonl")
    steps, losses, window, first, last = _loss_trend(records)
    balance = [r.get("load_balancing_loss") for r in records]
    load = [r.get("expert_load_max_over_mean") for r in records]
    figures = {"steps": len(steps), "loss_first": first, "loss_last": last, "window": window,
               "load_balancing_loss_last": balance[-1] if balance else None,
               "expert_load_max_over_mean_last": load[-1] if load else None}
    measured = [v for v in balance + load if v is not None]
    ok = (steps == list(range(1, args.steps + 1)) and all(map(math.isfinite, losses + measured))
          and len(measured) == 2 * len(records) and last < args.max_loss_ratio * first)
    experts_ok, experts_text = _moe_experts(work, args, figures)
    return ok and experts_ok, figures, (
        f"steps 1-{steps[-1] if steps else 0} ({len(steps)} logged), loss {first:.3f} "
        f"(first {window}) -> {last:.3f} (last {window}), must fall below "
        f"{args.max_loss_ratio:.2f}x; balance loss {figures['load_balancing_loss_last']}, "
        f"experts max/mean {figures['expert_load_max_over_mean_last']}; {experts_text}")


def _moe_experts(work: Path, args, figures: dict) -> tuple[bool, str]:
    """The run's experts (its ``layers:`` line) and ``bench moe``'s grouped vs sequential figures, into
    ``figures``: (passed, the summary's words)."""
    log = (work / "f_moe.log").read_text(errors="replace") if (work / "f_moe.log").exists() else ""
    bench = json.loads((work / "f_bench.result.json").read_text())
    trained = f"experts: {args.experts}" in log
    figures.update({"experts_trained": args.experts if trained else None, "bench_shape": bench["shape"],
                    "sequential_ms": bench["sequential_ms"], "grouped_ms": bench["grouped_ms"],
                    "grouped_speedup": bench["speedup"], "stack_ms": bench["stack_ms"],
                    "output_relative_diff": bench["output_relative_diff"]})
    ok = trained and bench["output_relative_diff"] <= MOE_OUTPUT_TOLERANCE
    target = "target not enforced in the rehearsal"
    if args.min_speedup is not None:
        ok, target = ok and bench["speedup"] >= args.min_speedup, f"target >= {args.min_speedup:.1f}x"
    shape = bench["shape"]
    return ok, (f"trained with {args.experts} experts{'' if trained else ' NOT seen in the log'}; bench moe "
                f"({shape['experts']} experts top-{shape['topk']}, hidden {shape['hidden']}, FFN {shape['ffn']}, "
                f"{bench['dtype']}): grouped {bench['grouped_ms']:.2f} ms vs sequential {bench['sequential_ms']:.2f} ms "
                f"= {bench['speedup']:.2f}x ({target}; weight stacking {bench['stack_ms']:.2f} ms), outputs within "
                f"{bench['output_relative_diff']:.1e} (<= {MOE_OUTPUT_TOLERANCE:.0e})")


def _fp8_run(work: Path, mode: str, steps: int) -> dict:
    records = _read_jsonl(work / "fp8" / f"train_{mode}" / "metrics.jsonl")
    losses = [r["loss"] for r in records]
    steady = records[max(1, steps // 5):]  # past the warm-up steps
    timed = [r["tokens_per_s"] for r in steady]
    tflops = [r.get("model_tflops_per_gpu") for r in steady]
    mfus = [r.get("mfu") for r in steady]
    window = max(1, min(10, len(losses) // 4))
    return {"steps": [r["step"] for r in records], "losses": losses,
            "tokens_per_s": sum(timed) / max(1, len(timed)), "final_loss": sum(losses[-window:]) / window,
            # The run's own throughput columns (profile.throughput): model FLOPs with the encoder.
            "model_tflops_per_gpu": _mean(tflops), "mfu": _mean(mfus)}


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def _throughput_text(run: dict) -> str:
    tflops = "n/a" if run["model_tflops_per_gpu"] is None else f"{run['model_tflops_per_gpu']:.1f}"
    mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
    return f"{tflops} model TFLOP/s/GPU, MFU {mfu}"


def check_fp8(work: Path, args) -> tuple[bool, dict, str]:
    policies = {path.stem.split("_tp")[-1]: json.loads(path.read_text())
                for path in sorted((work / "fp8").glob("policy_tp*.json"))}
    # Each kind's recipe: torchao's tensorwise or rowwise, or loongforge's scaled_mm GEMMs.
    chosen = {tp: sorted(f"{kind} ({by_tp[tp].get('recipe') or 'scaled_mm'})" for kind, by_tp in policy["layers"].items()
                         if by_tp[tp]["min_tokens"] is not None) for tp, policy in policies.items()}
    unmeasured = sorted({policy.get("torchao_unmeasured") for policy in policies.values()} - {None})
    off, auto = _fp8_run(work, "off", args.steps), _fp8_run(work, "auto", args.steps)
    ratio = auto["tokens_per_s"] / off["tokens_per_s"]
    loss_diff = abs(auto["final_loss"] - off["final_loss"]) / abs(off["final_loss"])
    log = (work / "g_fp8.log").read_text(errors="replace")
    said = [line for line in log.splitlines() if line.startswith("fp8: auto")]
    figures = {"fp8_kinds_by_tp": chosen, "torchao_unmeasured": unmeasured[0] if unmeasured else None,
               "tokens_per_s_bf16": off["tokens_per_s"],
               "tokens_per_s_fp8_auto": auto["tokens_per_s"], "ratio": ratio, "final_loss_bf16": off["final_loss"],
               "final_loss_fp8_auto": auto["final_loss"], "loss_diff": loss_diff, "fp8_line": said[-1] if said else None,
               "model_tflops_per_gpu_bf16": off["model_tflops_per_gpu"], "mfu_bf16": off["mfu"],
               "model_tflops_per_gpu_fp8_auto": auto["model_tflops_per_gpu"], "mfu_fp8_auto": auto["mfu"]}
    complete = all(run["steps"] == list(range(1, args.steps + 1)) and all(map(math.isfinite, run["losses"]))
                   for run in (off, auto))
    ok = complete and bool(said) and len(policies) > 0
    targets = args.min_ratio is not None
    # The run trains at TP 1; a TP 1 policy that measured bf16 faster for every kind meets the target
    # by saying so (issue 54): auto then trains bf16, as fast as bf16.
    bf16_everywhere = policies.get("1") is not None and not chosen.get("1")
    figures["policy_bf16_everywhere"] = bf16_everywhere
    if targets:
        ok = ok and (ratio >= args.min_ratio or bf16_everywhere) and loss_diff <= args.max_loss_diff
    kinds = "; ".join(f"TP {tp}: {', '.join(kinds) or 'none'}" for tp, kinds in chosen.items())
    target_text = (f"targets >= {args.min_ratio:.2f}x, <= {100 * args.max_loss_diff:.0f}%" if targets
                   else "targets not enforced in the rehearsal")
    if bf16_everywhere:
        kinds += " (the TP 1 policy measured bf16 faster for every kind: auto trains bf16)"
    if unmeasured:
        kinds += f"; {unmeasured[0]}"
    return ok, figures, (f"FP8 layer kinds (recipe) by policy: {kinds}; fp8-auto / bf16 tokens/s {ratio:.3f}x, final loss "
                         f"{auto['final_loss']:.4f} vs {off['final_loss']:.4f} ({100 * loss_diff:.2f}%; {target_text}); "
                         f"7B-shaped stack bf16 {_throughput_text(off)}, fp8-auto {_throughput_text(auto)}")


def check_hybrid(work: Path, args) -> tuple[bool, dict, str]:
    rule = json.loads((work / "h_rule.result.json").read_text())
    records = _read_jsonl(work / "hybrid" / "metrics.jsonl")
    steps, losses, window, first, last = _loss_trend(records)
    bench = json.loads((work / "h_bench.result.json").read_text())
    growth = {variant: entries[-1]["time_ratio"] for variant, entries in bench["growth"].items()}
    worst = max(rule["relative_diff"].values())
    figures = {"rule": rule["rule"], "rule_relative_diff": rule["relative_diff"], "steps": len(steps),
               "loss_first": first, "loss_last": last, "bench_rows": bench["rows"], "bench_time_growth": growth}
    ok = (rule["rule"] == args.rule and worst <= rule["tolerance"] and steps == list(range(1, args.steps + 1))
          and all(map(math.isfinite, losses)) and last < args.max_loss_ratio * first)
    lengths = bench["options"]["seq_lens"]
    return ok, figures, (f"rule {rule['rule']} (expected {args.rule}) vs token by token: {worst:.1e} of the largest "
                         f"(<= {rule['tolerance']:.0e}); loss {first:.3f} -> {last:.3f} over {len(steps)} steps; step "
                         f"time from {lengths[0]} to {lengths[-1]} tokens: "
                         + ", ".join(f"{variant} x{ratio:.1f}" for variant, ratio in growth.items()))


def check_varlen(work: Path, args) -> tuple[bool, dict, str]:
    result = json.loads((work / "i_varlen.result.json").read_text())
    row = (f"{result['tokens']} tokens in {result['segments']} samples, {result['heads']} heads / "
           f"{result['groups']} groups x {result['head_dim']}, {result['dtype']}")
    if "relative_diff" not in result:  # varlen cannot run here: the step passes only where none was expected
        ok = args.kernel == "sdpa" and result["auto_backend"] != "varlen"
        return ok, result, (f"SDPA per segment {result['sdpa_ms']:.1f} ms fwd+bwd ({row}); varlen {result['varlen']} "
                            f"(expected {args.kernel})")
    worst = max(result["relative_diff"].values())
    ok = args.kernel == "varlen" and worst <= result["tolerance"]
    if args.min_ratio is not None:
        ok = ok and result["speedup"] >= args.min_ratio
    return ok, result, (f"varlen {result['varlen_ms']:.2f} ms vs SDPA per segment {result['sdpa_ms']:.2f} ms fwd+bwd "
                        f"(x{result['speedup']:.2f}; {row}); largest difference {worst:.1e} of the largest "
                        f"(<= {result['tolerance']:.0e}); auto picks {result['auto_backend']}")


def check_compile(work: Path, args) -> tuple[bool, dict, str]:
    record = json.loads((work / "j_compile.result.json").read_text())
    results, tolerance = record["results"], record["tolerance"]
    longest = {}
    for result in results:  # each part's figures at its longest row
        if result["tokens"] >= longest.get(result["part"], {}).get("tokens", 0):
            longest[result["part"]] = result
    speedups = {part: r["eager_ms"] / r["compiled_ms"] for part, r in longest.items()}
    worst = max(max(r["worst"], r["worst_summed"]) for r in results)
    figures = {"tolerance": tolerance, "worst": worst, "speedup_at_longest_row": speedups,
               "faster_compiled": sorted(part for part, x in speedups.items() if x >= 1.0), "auto": record["auto"],
               "first_call_s": {r["part"]: r["first_call_s"] for r in results}}
    ok = bool(results) and worst <= tolerance
    return ok, figures, (f"compiled / eager speed at {max(r['tokens'] for r in results)} tokens ({record['dtype']}): "
                         + ", ".join(f"{part} x{x:.2f}" for part, x in speedups.items())
                         + f"; largest difference {worst:.1e} (<= {tolerance:.0e}) against eager in fp64; auto "
                           f"compiles {', '.join(record['auto']) or 'nothing'} here")


CHECKS = {"a_train": check_train, "b_parity": check_parity, "c_bench": check_bench,
          "d_pytest": check_pytest, "e_cost": check_cost, "f_moe": check_moe, "g_fp8": check_fp8,
          "h_hybrid": check_hybrid, "i_varlen": check_varlen, "j_compile": check_compile}


def cmd_check(args) -> int:
    work = Path(args.work)
    try:
        ok, figures, line = CHECKS[args.step](work, args)
    except Exception as exc:  # a step that died leaves files missing: that is its FAIL line
        ok, figures, line = False, {}, f"no result ({type(exc).__name__}: {exc})"
    if args.rc != 0:
        ok = False
        line += f" [exit code {args.rc}{', timed out' if args.rc in (124, 137) else ''}]"
    commands = work / f"{args.step}.cmds"
    record = {"step": args.step, "title": TITLES[args.step], "passed": ok, "summary": line,
              "figures": figures, "seconds": args.seconds, "rc": args.rc, "timeout_s": args.timeout,
              "commands": commands.read_text().splitlines() if commands.exists() else []}
    (work / f"{args.step}.status.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"{'PASS' if ok else 'FAIL'} {TITLES[args.step]} ({args.seconds:.0f} s): {line}", flush=True)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def _step_section(record: dict) -> list[str]:
    lines = [f"### {record['title']}: {'PASS' if record['passed'] else 'FAIL'}", "",
             f"{record['summary']} ({record['seconds']:.0f} s of a {record['timeout_s']} s limit)", ""]
    if record["step"] == "c_bench" and record["figures"].get("runs"):
        from loongforge.bench.model_step import format_markdown

        lines += [format_markdown(record["figures"]), ""]
    if record["commands"]:
        lines += ["```bash", *record["commands"], "```", ""]
    return lines


def cmd_report(args) -> int:
    work = Path(args.work)
    records = [json.loads((work / f"{s}.status.json").read_text()) for s in STEPS
               if (work / f"{s}.status.json").exists()]
    machine = json.loads((work / "machine.json").read_text()) if (work / "machine.json").exists() else {}
    passed = sum(r["passed"] for r in records)
    lines = ["# GPU check", "",
             f"`bash scripts/gpu_check.sh{' --cpu-rehearsal' if args.mode == 'cpu-rehearsal' else ''}` "
             f"({args.mode}), {machine.get('date', '?')}: {passed}/{len(STEPS)} steps passed.", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "date"), "",
             "| step | result | seconds | figures |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['title']} | {'PASS' if r['passed'] else 'FAIL'} | {r['seconds']:.0f} | "
                     f"{r['summary'].replace('|', '/')} |")
    lines.append("")
    for r in records:
        lines += _step_section(r)
    Path(args.output).write_text("\n".join(lines))
    (work / "gpu_results.json").write_text(json.dumps({"machine": machine, "steps": records}, indent=2,
                                                      default=str) + "\n")
    print(f"wrote {args.output}: {passed}/{len(STEPS)} steps passed")
    return 0 if passed == len(STEPS) else 1


def _nvidia_smi() -> dict:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"driver, memory": out} if out else {}


def cmd_machine(args) -> int:
    """Versions and device of this machine, for the report."""
    import datetime
    import os
    import platform

    import torch

    from loongforge.train.runner import library_versions

    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
            "cuda": torch.version.cuda, "cpus": os.cpu_count(), "platform": platform.platform(),
            **library_versions(), **_nvidia_smi()}
    Path(args.output).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO))  # tests.models.helpers for the parity step
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("overrides")
    p.add_argument("--preset", default="qwen2.5vl-7b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--language-layers", type=int, default=4)
    p.add_argument("--vision-blocks", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16")
    p = sub.add_parser("parity")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", required=True)
    p = sub.add_parser("linear-attention")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", required=True)
    p = sub.add_parser("varlen")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p = sub.add_parser("compile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", default="norm,rope,swiglu,grouped_swiglu,permute")
    p = sub.add_parser("check")
    p.add_argument("step", choices=STEPS)
    p.add_argument("--work", required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--timeout", type=int, default=0)
    p.add_argument("--steps", type=int, default=30, help="a_train, f_moe: steps the run must log")
    p.add_argument("--exit-at", type=int, default=20, help="a_train: step of the first run's exit")
    p.add_argument("--max-loss-ratio", type=float, default=0.9, help="a_train, f_moe: last/first loss below this")
    p.add_argument("--require-baseline", action="store_true", help="c_bench: transformers must have run")
    p.add_argument("--target", type=float, default=None, help="e_cost: median error limit, %%")
    p.add_argument("--experts", default="grouped", help="f_moe: the experts the run's layers line must name")
    p.add_argument("--min-speedup", type=float, default=None, help="f_moe: grouped / sequential experts at least")
    p.add_argument("--min-ratio", type=float, default=None,
                   help="g_fp8: fp8-auto / bf16 tokens/s at least; i_varlen: varlen / SDPA speed at least")
    p.add_argument("--max-loss-diff", type=float, default=None, help="g_fp8: relative final-loss difference at most")
    p.add_argument("--rule", default="fla", help="h_hybrid: the gated delta rule the device must pick (fla | torch)")
    p.add_argument("--kernel", default="varlen", help="i_varlen: the packed-attention kernel expected (varlen | sdpa)")
    p = sub.add_parser("report")
    p.add_argument("--work", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--mode", default="gpu")
    p = sub.add_parser("machine")
    p.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    # Its steps import megatron-core, whose fallback notices a CPU run hides (they show on CUDA), as train does.
    from loongforge.parallel.console import filter_known_warnings

    filter_known_warnings(verbose=False, on_cuda=getattr(args, "device", "cpu") == "cuda")
    commands = {"overrides": cmd_overrides, "parity": cmd_parity, "linear-attention": cmd_linear_attention,
                "varlen": cmd_varlen, "compile": cmd_compile,
                "check": cmd_check,
                "report": cmd_report, "machine": cmd_machine}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
