"""``loongforge bench``: benchmarks, one subcommand each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import UsageError, cli_errors
from loongforge.cli.options import ConfigFileOption, NprocPerNodeOption, PresetOption
from loongforge.config.schema import SUGGESTED_LOSS_CHUNK_TOKENS

# The default cost model describes Qwen2.5-VL-7B; its preset gives the matching seq_len and image rules.
BALANCE_PRESET = "qwen2.5vl-7b"
# Reports go under an ignored folder of the working directory, one subfolder per bench.
DEFAULT_OUT = Path("outputs") / "bench"

app = typer.Typer(name="bench", help="Benchmarks: load balancing (simulated and trained), packing, model step "
                  "throughput, encoder data parallelism.", no_args_is_help=True,
                  add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. 8,32,128") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} {text!r}: expected positive integers, e.g. 8,32,128")
    return values


@app.command("balance")
def balance(
    data: Annotated[list[str], typer.Option(
        "--data", metavar="PATH", show_default=False,
        help="Packed folder (manifest.jsonl), OmniBal CSV, MathVista/COCO json or conversation "
             "files; repeat for more; all form one pool.")],
    preset: Annotated[Optional[str], typer.Option(
        "--preset", "-p", metavar="NAME", show_default=False,
        help=f"Preset whose tokenizer, image rules and data.seq_len apply. Default: {BALANCE_PRESET} "
             "(the model the default cost model describes).")] = None,
    cost: Annotated[Optional[Path], typer.Option(
        "--cost", metavar="COST.json", show_default=False,
        help="Cost model from `loongforge fit-cost`. "
             "Default: the documented qwen2.5vl-7b H100 model.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", min=1, metavar="N", show_default=False,
        help="Tokens per micro-batch. Default: the preset's data.seq_len.")] = None,
    dp: Annotated[str, typer.Option(
        "--dp", metavar="8,32,...", help="DP sizes.")] = "8,32,128,256,512,1024",
    ga: Annotated[str, typer.Option("--ga", metavar="1,4", help="Micro-batches per rank per step.")] = "1,4",
    steps: Annotated[int, typer.Option(
        "--steps", min=1, metavar="N", help="Simulated steps per (DP, GA).")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sample draws.")] = 0,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write balance.md (table + settings) and gain_vs_dp.png here. Default: outputs/bench/balance/.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object {rows: [...]} only.")] = False,
) -> None:
    """Simulate DP load balancing on real sample costs: none / token / reference / loongforge."""
    from loongforge.balance.planner import PlanError
    from loongforge.bench.balance import describe_bench, format_table, plot_gain, run_balance_bench
    from loongforge.config.loader import load_run_config

    with cli_errors():
        dp_sizes, micro_batches = _int_list(dp, "--dp"), _int_list(ga, "--ga")
        preset = preset or BALANCE_PRESET
        if seq_len is None:
            seq_len = load_run_config(preset).data.seq_len
        try:
            bench = run_balance_bench(data, preset=preset, seq_len=seq_len, cost=cost,
                                      dp_sizes=dp_sizes, micro_batches=micro_batches, steps=steps,
                                      seed=seed)
        except (PlanError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        if as_json:
            typer.echo(json.dumps({"rows": bench.rows}))
            return
        table, about = format_table(bench.rows), describe_bench(bench)
        typer.echo(table)
        typer.echo(about)
        out = out or DEFAULT_OUT / "balance"
        out.mkdir(parents=True, exist_ok=True)
        plot_gain(bench.rows, out / "gain_vs_dp.png")
        (out / "balance.md").write_text(f"{table}\n\n```\n{about}\n```\n")
        typer.echo(f"wrote {out / 'balance.md'} and {out / 'gain_vs_dp.png'}")


@app.command("pack")
def pack(
    data_root: Annotated[Optional[Path], typer.Option(
        "--data-root", metavar="DIR", show_default=False,
        help="The shared data folder (coco2017/, mathvista/, arena_hard/, llamafactory/). "
             "Default: $LOONGFORGE_SHARED_DATA.")] = None,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="Preset whose tokenizer and image rules size the samples.")]
        = "qwen2.5vl-7b",
    seq_len: Annotated[str, typer.Option("--seq-len", metavar="8192,32768", help="Pack capacities.")]
        = "8192,32768",
    plan_samples: Annotated[int, typer.Option(
        "--plan-samples", min=1, metavar="N", help="Samples for the plan-speed run.")] = 1_000_000,
    scan_samples: Annotated[int, typer.Option(
        "--scan-samples", min=1, metavar="N", help="Samples for the scan-speed run.")] = 4000,
    workers: Annotated[str, typer.Option("--workers", metavar="1,2", help="Worker counts for the scan run.")]
        = "1,2",
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write pack.md (tables) and pack.png (fill ratios, length histogram) here. Default: outputs/bench/pack/.")]
        = None,
) -> None:
    """Fill ratio of bfd/ffd/balanced vs first-fit and greedy knapsack on real sets; plan and scan speed."""
    from loongforge.bench.datasets import resolve_data_root
    from loongforge.bench.chat_sets import REQUIRED
    from loongforge.bench.pack import plot, report, run_pack_bench

    with cli_errors():
        root = resolve_data_root(data_root, REQUIRED)
        bench = run_pack_bench(root, preset=preset, seq_lens=tuple(_int_list(seq_len, "--seq-len")),
                               plan_samples=plan_samples, scan_samples=scan_samples,
                               scan_workers=tuple(_int_list(workers, "--workers")),
                               on_progress=lambda message: typer.echo(f"... {message}", err=True))
        out = out or DEFAULT_OUT / "pack"
        out.mkdir(parents=True, exist_ok=True)
        plot(bench, out / "pack.png")
        text = report(bench, "pack.png")
        (out / "pack.md").write_text(text)
        typer.echo(text)
        typer.echo(f"wrote {out / 'pack.md'} and {out / 'pack.png'}")


@app.command("train")
def train(
    inputs: Annotated[Optional[list[str]], typer.Argument(
        metavar="[DATA...] [KEY=VALUE...]", show_default=False,
        help="Dataset files (as for data.paths; default: the preset's data) and dotted overrides.")] = None,
    cost: Annotated[Path, typer.Option(
        "--cost", metavar="COST.json", show_default=False,
        help="Cost model from `loongforge fit-cost` for this model and machine; the balanced run "
             "prices samples with it and the prediction uses it.")] = None,
    preset: PresetOption = None,
    config: ConfigFileOption = None,
    steps: Annotated[int, typer.Option("--steps", min=2, metavar="N", help="Steps per run.")] = 12,
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, metavar="N", help="First steps of each run left out of the figures.")] = 2,
    nproc_per_node: NprocPerNodeOption = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write train.md, train.json, train.png and both profiles here. Default: outputs/bench/train/.")]
        = None,
    order: Annotated[str, typer.Option(
        "--order", metavar="off-on|on-off",
        help="Which run goes first. A machine that speeds up or slows down over time favours one "
             "order; running both orders (two --out folders) cancels that.")] = "off-on",
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="Train nothing: rebuild the report from off.jsonl and on.jsonl in --out "
                              "(e.g. with another --cost).")] = False,
) -> None:
    """Train the same steps with balancing off and on; measured step time and wait vs the prediction."""
    import sys

    from loongforge.bench.train import ORDERS, run_train_bench
    from loongforge.cli.profile import split_inputs

    with cli_errors():
        if cost is None:
            raise UsageError("--cost COST.json is required: profile (`loongforge profile --sweep`) and fit "
                             "(`loongforge fit-cost`) this model on this machine first")
        if warmup_steps >= steps:
            raise UsageError(f"--warmup-steps {warmup_steps} leaves no measured step of --steps {steps}")
        if order not in ORDERS:
            raise UsageError(f"--order {order!r} is not one of {' | '.join(ORDERS)}")
        data, overrides = split_inputs(inputs or [])
        out = out or DEFAULT_OUT / "train"
        _, report = run_train_bench(
            out, cost=cost, preset=preset, config_file=config, data=data, overrides=overrides, steps=steps,
            warmup_steps=warmup_steps, nproc_per_node=nproc_per_node, order=order, report_only=report_only,
            command_line=sys.argv, progress=lambda message: typer.echo(f"... {message}", err=True))
        typer.echo(report)
        typer.echo(f"wrote {out / 'train.md'}, {out / 'train.json'} and {out / 'train.png'}")


def _image_sizes(text: str) -> tuple:
    """'448x448,1280x720' -> ((448, 448), (1280, 720)); '' or 'none' -> no images."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        sizes = tuple(tuple(int(v) for v in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        sizes = ((),)
    if any(len(size) != 2 or min(size) < 1 for size in sizes):
        raise UsageError(f"--images {text!r}: expected WIDTHxHEIGHT pixel sizes, e.g. 448x448,1280x720")
    return sizes


def _show_result(result: dict, text: str, output: Optional[Path], as_json: bool) -> None:
    """Print a bench's result (its markdown, or one JSON object with --json) and write it to ``output`` (JSON
    for a .json suffix, the markdown otherwise)."""
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n" if output.suffix == ".json" else text)
    typer.echo(json.dumps(result) if as_json else text)
    if output is not None and not as_json:
        typer.echo(f"wrote {output}")


@app.command("moe")
def moe(
    experts: Annotated[Optional[int], typer.Option(
        "--experts", min=1, metavar="N", show_default=False, help="Experts of the layer. Default: 128.")] = None,
    topk: Annotated[Optional[int], typer.Option(
        "--topk", min=1, metavar="K", show_default=False, help="Experts per token. Default: 8.")] = None,
    hidden: Annotated[Optional[int], typer.Option(
        "--hidden", min=1, metavar="H", show_default=False,
        help="Hidden size. Default: 2048 on CUDA (Qwen3-30B-A3B), 512 on the CPU.")] = None,
    ffn: Annotated[Optional[int], typer.Option(
        "--ffn", min=1, metavar="F", show_default=False,
        help="Each expert's FFN width. Default: 768 on CUDA (Qwen3-30B-A3B), 192 on the CPU.")] = None,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", min=1, metavar="T", show_default=False,
        help="Tokens into the layer (T x topk expert rows). Default: 8192 on CUDA, 1024 on the CPU.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, metavar="N", help="Timed steps per module.")] = 5,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", min=0, metavar="N", help="Untimed steps first.")] = 2,
    device: Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to run.")] = "auto",
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", metavar="bf16|fp32", show_default=False,
        help="Weights and activations. Default: bf16 on CUDA (torch._grouped_mm's), fp32 on the CPU.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", metavar="RESULT.json|RESULT.md", show_default=False,
        help="Also write the result: JSON (.json) or markdown with the command (any other suffix).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object only.")] = False,
) -> None:
    """Grouped-GEMM experts (model.language.moe.experts=grouped) against megatron's SequentialMLP: one MoE
    layer's experts, forward + backward, at Qwen3-30B-A3B's shapes on CUDA and a quarter of its widths on the CPU."""
    import dataclasses
    import sys

    from loongforge.bench.moe import CPU_SHAPE, QWEN3_30B_A3B, format_markdown, run_moe_bench
    from loongforge.parallel.distributed import resolve_device

    with cli_errors():
        if device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {device!r} is not one of auto | cpu | cuda")
        on_cuda = resolve_device(device).type == "cuda"
        dtype = dtype or ("bf16" if on_cuda else "fp32")
        if dtype not in ("bf16", "fp32"):
            raise UsageError(f"--dtype {dtype!r} is not one of bf16 | fp32")
        given = {"experts": experts, "topk": topk, "hidden": hidden, "ffn": ffn, "tokens": tokens}
        shape = dataclasses.replace(QWEN3_30B_A3B if on_cuda else CPU_SHAPE,
                                    **{k: v for k, v in given.items() if v is not None})
        if shape.topk > shape.experts:
            raise UsageError(f"--topk {shape.topk} is more than --experts {shape.experts}")
        result = run_moe_bench(shape, device="cuda" if on_cuda else "cpu", dtype=dtype, steps=steps,
                               warmup=warmup_steps, log=lambda message: typer.echo(f"... {message}", err=True))
        result["command"] = " ".join(["loongforge", *sys.argv[1:]])
        _show_result(result, format_markdown(result, result["command"]), output, as_json)


@app.command("model")
def model(
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="[KEY=VALUE...]", show_default=False,
        help="Dotted overrides applied to the preset before the bench's own (e.g. model.vision.window.size=112).")]
        = None,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="Preset whose widths, vocabulary and image rules apply.")]
        = "qwen2.5vl-7b",
    language_layers: Annotated[int, typer.Option(
        "--language-layers", min=0, metavar="N", help="Decoder layers; 0 keeps the preset's depth.")] = 4,
    vision_blocks: Annotated[int, typer.Option(
        "--vision-blocks", min=0, metavar="N",
        help="ViT blocks: the real tower's first N, its full-attention blocks among them; 0 keeps the "
             "preset's depth.")] = 8,
    tokens: Annotated[int, typer.Option("--tokens", min=8, metavar="N", help="Tokens per micro-batch.")] = 8192,
    samples: Annotated[int, typer.Option(
        "--samples", min=1, metavar="N", help="Equal-length samples packed into the micro-batch, one image each.")]
        = 4,
    images: Annotated[Optional[str], typer.Option(
        "--images", metavar="WxH,...", show_default=False,
        help="Image sizes in pixels, one per sample (cycled), resized by the preset's pixel limits; "
             "'none' for text only. Default: 448x448,1280x720,644x644,504x896.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, metavar="N", help="Timed steps per variant.")] = 10,
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, metavar="N", help="Untimed steps before them.")] = 3,
    device: Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to run.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", metavar="bf16|fp32", help="Parameter and compute dtype.")]
        = "bf16",
    baseline: Annotated[bool, typer.Option(
        "--baseline/--no-baseline", help="Also time the family's transformers class (sdpa).")]
        = True,
    batch_variant: Annotated[bool, typer.Option(
        "--batch-variant/--no-batch-variant", help="Also time loongforge on the unpacked batch transformers gets.")]
        = True,
    peak_tflops: Annotated[Optional[float], typer.Option(
        "--peak-tflops", min=0.0, metavar="TFLOPS", show_default=False,
        help="Peak of the device in this dtype, for MFU. Default: 989 on H100/H200 in bf16, else no MFU.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", metavar="RESULT.json|RESULT.md", show_default=False,
        help="Also write the result: JSON (.json) or a markdown table (any other suffix).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object only.")] = False,
) -> None:
    """Forward+backward tokens/s and MFU of the model on one device, next to transformers."""
    from loongforge.bench.model_step import ModelBenchOptions, format_markdown, run_model_bench

    with cli_errors():
        if device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {device!r} is not one of auto | cpu | cuda")
        if dtype not in ("bf16", "fp32"):
            raise UsageError(f"--dtype {dtype!r} is not one of bf16 | fp32")
        if tokens % samples:
            raise UsageError(f"--tokens {tokens} must be a multiple of --samples {samples}")
        opts = ModelBenchOptions(
            preset=preset, language_layers=language_layers or None, vision_blocks=vision_blocks or None,
            tokens=tokens, samples=samples, steps=steps,
            warmup_steps=warmup_steps, device=device, dtype=dtype, baseline=baseline,
            batch_variant=batch_variant, peak_tflops=peak_tflops, overrides=list(overrides or []))
        if images is not None:
            opts.image_sizes = _image_sizes(images)
        result = run_model_bench(opts, log=lambda message: typer.echo(f"... {message}", err=True))
        _show_result(result, format_markdown(result), output, as_json)


@app.command("hybrid")
def hybrid(
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="A hybrid preset: its widths and its layer pattern.")]
        = "qwen3.5-tiny-small-vocab",
    seq_lens: Annotated[str, typer.Option(
        "--seq-lens", metavar="N,N,...", help="Tokens of the one sample in each row.")] = "2048,8192,32768",
    layers: Annotated[int, typer.Option("--layers", min=1, metavar="N", help="Decoder layers of both variants.")] = 4,
    steps: Annotated[int, typer.Option("--steps", min=1, metavar="N", help="Timed steps per point.")] = 3,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", min=0, metavar="N", help="Untimed steps first.")] = 1,
    device: Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to run.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", metavar="bf16|fp32", help="Parameter and compute dtype.")] = "fp32",
    output: Annotated[Optional[Path], typer.Option(
        "--output", metavar="RESULT.json|RESULT.md", show_default=False,
        help="Also write the result: JSON (.json) or a markdown table (any other suffix).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object only.")] = False,
) -> None:
    """Step time and activation memory of a hybrid linear-attention decoder as the sequence grows, beside the
    same decoder with every layer full attention."""
    from loongforge.bench.hybrid import HybridBenchOptions, format_markdown, run_hybrid_bench

    with cli_errors():
        if device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {device!r} is not one of auto | cpu | cuda")
        if dtype not in ("bf16", "fp32"):
            raise UsageError(f"--dtype {dtype!r} is not one of bf16 | fp32")
        try:
            lengths = sorted({int(part) for part in seq_lens.split(",") if part.strip()})
        except ValueError:
            raise UsageError(f"--seq-lens {seq_lens!r}: give whole token counts separated by commas") from None
        if not lengths or lengths[0] < 16:
            raise UsageError(f"--seq-lens {seq_lens!r}: give at least one length of 16 tokens or more")
        opts = HybridBenchOptions(preset=preset, seq_lens=lengths, layers=layers, steps=steps,
                                  warmup_steps=warmup_steps, device=device, dtype=dtype)
        result = run_hybrid_bench(opts, log=lambda message: typer.echo(f"... {message}", err=True))
        _show_result(result, format_markdown(result), output, as_json)


@app.command("loss")
def loss(
    tokens: Annotated[int, typer.Option("--tokens", min=1, metavar="N", help="Loss tokens of the row.")] = 4096,
    vocab_size: Annotated[int, typer.Option("--vocab-size", min=2, metavar="V", help="The head's rows.")] = 152064,
    hidden_size: Annotated[int, typer.Option(
        "--hidden-size", min=1, metavar="H", help="The head's width (the GEMMs' time and the weight's gradient).")]
        = 128,
    chunk_tokens: Annotated[int, typer.Option(
        "--chunk-tokens", min=1, metavar="N", help="Tokens per chunk (the dry run suggests the default).")]
        = SUGGESTED_LOSS_CHUNK_TOKENS,
    dtype: Annotated[str, typer.Option("--dtype", metavar="bf16|fp32", help="Hidden states and weight.")] = "fp32",
    steps: Annotated[int, typer.Option("--steps", min=1, metavar="N", help="Timed steps (median).")] = 2,
    threads: Annotated[int, typer.Option("--threads", min=1, metavar="N", help="torch's CPU threads.")] = 1,
    output: Annotated[Optional[Path], typer.Option(
        "--output", metavar="RESULT.json|RESULT.md", show_default=False,
        help="Also write the result: JSON (.json) or a markdown table (any other suffix).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object only.")] = False,
) -> None:
    """Peak memory and time of the LM head's loss step on CPU, whole logits vs chunked
    (training.loss_chunk_tokens), each in a fresh process."""
    from loongforge.bench.loss import LossBenchOptions, format_markdown, run_loss_bench

    with cli_errors():
        if dtype not in ("bf16", "fp32"):
            raise UsageError(f"--dtype {dtype!r} is not one of bf16 | fp32")
        opts = LossBenchOptions(tokens=tokens, vocab_size=vocab_size, hidden_size=hidden_size,
                                chunk_tokens=chunk_tokens, dtype=dtype, steps=steps, threads=threads)
        result = run_loss_bench(opts, log=lambda message: typer.echo(f"... {message}", err=True))
        _show_result(result, format_markdown(result), output, as_json)


@app.command("gemm")
def gemm(
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="[KEY=VALUE...]", show_default=False, help="Dotted overrides applied to the preset.")] = None,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="Preset whose layers (widths, TP sizes, token counts) are timed.")]
        = "qwen2.5vl-7b",
    tp: Annotated[Optional[int], typer.Option(
        "--tp", min=1, metavar="N", show_default=False,
        help="Language TP size (vision and expert TP follow unless the preset sets them). Default: the preset's.")]
        = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option(
        "--sequence-parallel/--no-sequence-parallel", show_default=False,
        help="Sequence parallelism of the language layers (with --tp above 1). Default: the preset's.")] = None,
    tokens: Annotated[Optional[str], typer.Option(
        "--tokens", metavar="N,N,...", show_default=False,
        help="GEMM row counts to time. Default: powers of two from 128 to the run's largest.")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, metavar="N", help="Timed repetitions per shape.")] = 20,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", min=0, metavar="N", help="Untimed ones before.")]
        = 5,
    device: Annotated[str, typer.Option("--device", metavar="auto|cpu|cuda", help="Where to time.")] = "auto",
    linear: Annotated[bool, typer.Option(
        "--linear/--gemms-only",
        help="Also time each kind as the whole layer training runs (megatron's linear at its TP size, one process "
             "per TP rank: communication and quantisation included); those rows decide the policy.")] = True,
    micro_batches: Annotated[Optional[int], typer.Option(
        "--micro-batches", min=1, metavar="N", show_default=False,
        help="Micro-batches per timed step of the whole linear (the weight is quantised once per step). "
             "Default: the run's, at most 4.")] = None,
    output: Annotated[Path, typer.Option(
        "--output", metavar="POLICY.json", help="The policy file (fp8.policy=...); the plot goes beside it (.png).")]
        = DEFAULT_OUT / "gemm" / "fp8_policy.json",
) -> None:
    """Every linear layer's GEMMs (forward, both backward) and the whole layer in bf16 and FP8 (loongforge's
    scaled_mm GEMMs and, on a GPU with FP8 GEMMs, torchao's tensorwise and rowwise float8, compiled): the
    FP8 policy per layer kind, its recipe and the token count from which it pays."""
    from loongforge.bench.gemm import at_tensor_parallel, format_table, run_gemm_bench, write_results
    from loongforge.config.loader import load_run_config
    from loongforge.parallel.distributed import resolve_device

    with cli_errors():
        if device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {device!r} is not one of auto | cpu | cuda")
        counts = None if tokens is None else _int_list(tokens, "--tokens")
        cfg = load_run_config(preset, overrides=list(overrides or []))
        if tp is not None or sequence_parallel is not None:
            cfg = at_tensor_parallel(cfg, cfg.parallel.tensor_model_parallel_size if tp is None else tp,
                                     sequence_parallel)
        bench = run_gemm_bench(cfg, tokens=counts, device=resolve_device(device), steps=steps, warmup=warmup_steps,
                               linear=linear, micro_batches=micro_batches,
                               log=lambda message: typer.echo(message, err=True))
        policy, plot = write_results(bench, output)
        typer.echo(format_table(bench))
        typer.echo(f"wrote {policy} (train with training.fp8=auto fp8.policy={policy}) and {plot}")


def _name_list(text: str, flag: str, allowed) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise UsageError(f"{flag} {text!r}: expected comma-separated names from {' | '.join(allowed)}")
    return names


# The options of the benches that train a grid of layouts x modes (bench.train_grid), spelled once.
GridDataRootOption = Annotated[Optional[Path], typer.Option(
    "--data-root", metavar="DIR", show_default=False,
    help="The shared data folder (its coco2017/ photos and captions are trained on). "
         "Default: $LOONGFORGE_SHARED_DATA.")]
GridStepsOption = Annotated[int, typer.Option("--steps", min=2, metavar="N", help="Training steps per run.")]
GridWarmupStepsOption = Annotated[int, typer.Option(
    "--warmup-steps", min=0, metavar="N", help="First steps of each run left out of the figures.")]
GridImagesPerSampleOption = Annotated[int, typer.Option(
    "--images-per-sample", min=1, metavar="N", help="COCO photos per caption chat.")]
GridSeqLenOption = Annotated[int, typer.Option(
    "--seq-len", min=64, metavar="N", help="Tokens per row (how many chats, so photos, share one).")]
GridMicroBatchesOption = Annotated[int, typer.Option(
    "--micro-batches", min=1, metavar="N", help="Micro-batches (rows) per step.")]
GridRepeatsOption = Annotated[int, typer.Option(
    "--repeats", min=1, metavar="N",
    help="Runs per layout and mode, in mirrored order (baseline, others, then others, baseline) so that "
         "a machine whose speed drifts favours no mode; figures are means over all of them.")]
GridReportOnlyOption = Annotated[bool, typer.Option(
    "--report-only", help="Train nothing: rebuild the report from the runs already in --out.")]


def _grid_settings(*, steps: int, warmup_steps: int, images_per_sample: int, seq_len: int, micro_batches: int,
                   repeats: int):
    """The grid's BenchSettings; UsageError when the warm-up leaves no step to measure."""
    from loongforge.bench.train_grid import BenchSettings

    if warmup_steps >= steps:
        raise UsageError(f"--warmup-steps {warmup_steps} leaves no measured step of --steps {steps}")
    return BenchSettings(steps=steps, warmup_steps=warmup_steps, images_per_sample=images_per_sample,
                         seq_len=seq_len, micro_batches=micro_batches, repeats=repeats)


def _run_grid_bench(run, grid, name: str, *, layouts: str, data_root: Optional[Path], out: Optional[Path],
                    **options):
    """Check --layouts and the data folder, train (or reread) the grid with ``run`` (a bench's
    ``run_*_bench``), print its table and one summary line per non-baseline run: (bench, data root,
    out folder)."""
    import sys

    from loongforge.bench.datasets import resolve_data_root
    from loongforge.bench.train_grid import REQUIRED, summary_lines

    layout_list = _name_list(layouts, "--layouts", tuple(grid.layouts))
    root = resolve_data_root(data_root, REQUIRED)
    out = out or DEFAULT_OUT / name
    bench = run(out, root, layouts=layout_list, command_line=sys.argv,
                progress=lambda message: typer.echo(f"... {message}", err=True), **options)
    typer.echo(bench.table)
    for line in summary_lines(bench.comparisons, grid):
        typer.echo(line)
    typer.echo(f"wrote {out / (name + '.md')}, {out / (name + '.json')} and {out / (name + '.png')}")
    return bench, root, out


def _typed_command() -> list[str]:
    """The command as typed, for a document (not the module path python -m saw)."""
    import sys

    return ["loongforge", *sys.argv[1:]]


@app.command("encoder-dp")
def encoder_dp(
    data_root: GridDataRootOption = None,
    modes: Annotated[str, typer.Option(
        "--modes", metavar="none,tp", help="parallel.encoder_dp modes to train; none (the baseline) is always run.")]
        = "none,tp",
    layouts: Annotated[str, typer.Option(
        "--layouts", metavar="tp2,tp2pp2", help="Process layouts: tp2 (2 processes), tp2pp2 (4).")]
        = "tp2,tp2pp2",
    steps: GridStepsOption = 4,
    warmup_steps: GridWarmupStepsOption = 1,
    images_per_sample: GridImagesPerSampleOption = 2,
    seq_len: GridSeqLenOption = 1152,
    micro_batches: GridMicroBatchesOption = 2,
    repeats: GridRepeatsOption = 1,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write encoder_dp.md, encoder_dp.json, encoder_dp.png and the runs here. "
             "Default: outputs/bench/encoder_dp/.")] = None,
    report_only: GridReportOnlyOption = False,
    doc: Annotated[Optional[Path], typer.Option(
        "--doc", metavar="FILE.md", show_default=False,
        help="Also write the benchmark document: these figures beside the cost model's prediction "
             "for Qwen2.5-VL-7B at TP 4 on the shared data's image mixes.")] = None,
) -> None:
    """Train the encoder-heavy preset with each parallel.encoder_dp mode: per-rank encoder time, step time, memory."""
    import shutil

    from loongforge.bench.encoder_dp import GRID, run_encoder_dp_bench, valid_modes
    from loongforge.bench.encoder_dp_doc import CPU_TENSOR_PARALLEL, format_doc
    from loongforge.bench.encoder_dp_predict import predict, predict_conversations
    from loongforge.bench.train_grid import DATA_FILE, PRESET
    from loongforge.config.validate import CHOICES

    with cli_errors():
        settings = _grid_settings(steps=steps, warmup_steps=warmup_steps, images_per_sample=images_per_sample,
                                  seq_len=seq_len, micro_batches=micro_batches, repeats=repeats)
        mode_list = valid_modes(_name_list(modes, "--modes", CHOICES["parallel.encoder_dp"]))
        bench, root, out = _run_grid_bench(run_encoder_dp_bench, GRID, "encoder_dp", layouts=layouts,
                                           data_root=data_root, out=out, modes=mode_list, settings=settings,
                                           report_only=report_only)
        if doc is not None:
            typer.echo("... predicting Qwen2.5-VL-7B at TP 4 on the shared image mixes", err=True)
            doc.parent.mkdir(parents=True, exist_ok=True)
            plot = doc.with_suffix(".png")
            shutil.copyfile(out / "encoder_dp.png", plot)
            cpu_prediction = predict_conversations(out / DATA_FILE, PRESET, group_size=CPU_TENSOR_PARALLEL,
                                                   seq_len=settings.seq_len)
            doc.write_text(format_doc(bench, predict(root), cpu_prediction, command_line=_typed_command(),
                                      plot_name=plot.name))
            typer.echo(f"wrote {doc} and {plot}")


@app.command("context-parallel")
def context_parallel(
    data_root: GridDataRootOption = None,
    layouts: Annotated[str, typer.Option(
        "--layouts", metavar="cp2,cp4", help="Process layouts: cp2 (CP 2, 2 processes), cp4 (CP 4, 4).")]
        = "cp2,cp4",
    steps: GridStepsOption = 4,
    warmup_steps: GridWarmupStepsOption = 1,
    images_per_sample: GridImagesPerSampleOption = 4,
    seq_len: GridSeqLenOption = 2304,
    micro_batches: GridMicroBatchesOption = 1,
    repeats: GridRepeatsOption = 1,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write context_parallel.md, .json, .png and the runs here. "
             "Default: outputs/bench/context_parallel/.")] = None,
    report_only: GridReportOnlyOption = False,
    doc: Annotated[Optional[Path], typer.Option(
        "--doc", metavar="FILE.md", show_default=False,
        help="Also write the benchmark document: these figures beside the FLOP prediction for "
             "Qwen2.5-VL-7B on a long-video row at CP 2/4/8 and NeMo AutoModel's published gain.")] = None,
) -> None:
    """Train the encoder-heavy preset at CP 2 and CP 4 with parallel.encoder_cp off and on: per-rank encoder
    time, step time, memory; and the predicted 7B gain on a long-video row."""
    from loongforge.bench.context_parallel import GRID, LAYOUTS, run_context_parallel_bench
    from loongforge.bench.context_parallel_doc import NEMO_AUTOMODEL_LINE, format_doc
    from loongforge.bench.encoder_dp_predict import (
        LONG_VIDEO_ROWS,
        format_context_parallel,
        predict_conversations,
        predict_long_video,
    )
    from loongforge.bench.train_grid import DATA_FILE, PRESET

    with cli_errors():
        settings = _grid_settings(steps=steps, warmup_steps=warmup_steps, images_per_sample=images_per_sample,
                                  seq_len=seq_len, micro_batches=micro_batches, repeats=repeats)
        bench, _, out = _run_grid_bench(run_context_parallel_bench, GRID, "context_parallel", layouts=layouts,
                                        data_root=data_root, out=out, settings=settings, report_only=report_only)
        predictions = predict_long_video()
        typer.echo(format_context_parallel(predictions))
        typer.echo(f"reference: {NEMO_AUTOMODEL_LINE}")
        if doc is not None:
            cpu_predictions = [predict_conversations(out / DATA_FILE, PRESET, group_size=LAYOUTS[name].processes,
                                                     seq_len=settings.seq_len) for name in LAYOUTS]
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(format_doc(bench, predictions, LONG_VIDEO_ROWS, cpu_predictions,
                                      command_line=_typed_command()))
            typer.echo(f"wrote {doc}")


@app.command("pipeline")
def pipeline(
    schedules: Annotated[str, typer.Option(
        "--schedules", metavar="pp2,pp2-vp2,pp2-vp4", help="Schedules to train: PP 2, PP 2 x VP 2, PP 2 x VP 4.")]
        = "pp2,pp2-vp2,pp2-vp4",
    micro_batches: Annotated[int, typer.Option("--micro-batches", min=2, metavar="M",
                                               help="Micro-batches per step (a multiple of PP 2).")] = 4,
    steps: Annotated[int, typer.Option("--steps", min=2, metavar="N", help="Steps per run.")] = 6,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", min=0, metavar="N",
                                              help="First steps left out of the figures.")] = 2,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write the runs and pipeline.md here. Default: outputs/bench/pipeline/.")] = None,
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="Reread the runs under --out instead of training.")] = False,
    doc: Annotated[Optional[Path], typer.Option(
        "--doc", metavar="FILE.md", show_default=False, help="Also write the report there.")] = None,
) -> None:
    """Train PP 2 and the interleaved PP 2 x VP schedules on CPU: each rank's waiting time per step (the
    bubble) beside the bubble the plan predicts."""
    from loongforge.bench.pipeline import SCHEDULES, PipelineSettings, format_doc, format_table, run_pipeline_bench

    with cli_errors():
        if micro_batches % 2:
            raise UsageError(f"--micro-batches {micro_batches}: the interleaved schedule needs a multiple of PP 2")
        if warmup_steps >= steps:
            raise UsageError(f"--warmup-steps {warmup_steps} leaves none of --steps {steps} to measure")
        names = _name_list(schedules, "--schedules", tuple(SCHEDULES))
        settings = PipelineSettings(micro_batches=micro_batches, steps=steps, warmup_steps=warmup_steps)
        out = out or DEFAULT_OUT / "pipeline"
        measures = run_pipeline_bench(out, schedules=names, settings=settings, report_only=report_only,
                                      command_line=_typed_command(),
                                      progress=lambda message: typer.echo(f"... {message}", err=True))
        typer.echo(format_table(measures))
        text = format_doc(measures, settings, " ".join(_typed_command()))
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.md").write_text(text)
        if doc is not None:
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(text)
        typer.echo(f"wrote {out / 'pipeline.md'}" + (f" and {doc}" if doc is not None else ""))


@app.command("lora")
def lora(
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="[KEY=VALUE...]", show_default=False,
        help="Dotted overrides for both variants (model size, data, steps).")] = None,
    preset: Annotated[str, typer.Option("--preset", "-p", metavar="NAME", help="The model both variants train.")]
        = "qwen2.5vl-tiny-small-vocab",
    rank: Annotated[int, typer.Option("--rank", min=1, metavar="R", help="lora.rank of the LoRA variant.")] = 16,
    alpha: Annotated[float, typer.Option("--alpha", metavar="A", help="lora.alpha of the LoRA variant.")] = 32.0,
    targets: Annotated[str, typer.Option("--targets", metavar="language,vision,projector",
                                         help="lora.targets of the LoRA variant.")] = "language",
    warmup_steps: Annotated[int, typer.Option(
        "--warmup-steps", min=0, metavar="N", help="First steps of each run left out of the step time.")] = 1,
    out: Annotated[Optional[Path], typer.Option("--out", metavar="DIR", help="Where the runs and lora.json go.")] = None,
    doc: Annotated[Optional[Path], typer.Option(
        "--doc", metavar="FILE.md", help="Also write the report with the command that made it.")] = None,
) -> None:
    """Full fine-tuning against LoRA on the same model, data and steps: trainable parameters,
    checkpoint size, peak memory per rank and step time, LoRA's as ratios of full's."""
    import sys

    from loongforge.bench.lora import format_report, run_lora_bench
    from loongforge.config.loader import load_run_config
    from loongforge.parallel.launch_env import runs_on_cuda

    with cli_errors():
        common = list(overrides or [])
        lora_options = [f"lora.rank={rank}", f"lora.alpha={alpha}", f"lora.targets=[{targets}]"]
        cfg = load_run_config(preset, overrides=[*common, *lora_options])  # refuses bad keys before any run
        if warmup_steps >= cfg.training.train_steps:
            raise UsageError(f"--warmup-steps {warmup_steps} leaves no measured step of training.train_steps="
                             f"{cfg.training.train_steps}")
        out = out or DEFAULT_OUT / "lora"
        out.mkdir(parents=True, exist_ok=True)
        measures = run_lora_bench(out, preset=preset, common=common, lora=lora_options, warmup_steps=warmup_steps,
                                  progress=lambda message: typer.echo(f"... {message}", err=True))
        report = format_report(measures, "cuda" if runs_on_cuda(cfg.training.device) else "cpu")
        typer.echo(report)
        typer.echo(f"wrote {out / 'lora.json'}")
        if doc is not None:
            command = " ".join(["loongforge", *sys.argv[1:]])
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(f"# Full fine-tuning vs LoRA, measured in one run\n\n```bash\n{command}\n```\n\n{report}\n")
            typer.echo(f"wrote {doc}")


@app.command("encode")
def encode(
    data_root: Annotated[Optional[Path], typer.Option(
        "--data-root", metavar="DIR", show_default=False,
        help="The shared data folder (its coco2017/ photos and captions). Default: $LOONGFORGE_SHARED_DATA.")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, metavar="N", help="Caption chats to encode and train on.")]
        = 32,
    steps: Annotated[int, typer.Option("--steps", min=2, metavar="N", help="Training steps per run.")] = 4,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write encode.md, encode.json, the encode folders and the runs here. Default: outputs/bench/encode/.")]
        = None,
    doc: Annotated[Optional[Path], typer.Option(
        "--doc", metavar="FILE.md", show_default=False, help="Also write the benchmark document here.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="A tqdm bar over the runs.")] = True,
) -> None:
    """Encode at 1 and 2 processes (media/s, bytes per token) and train from stored embeddings vs the frozen encoder."""
    import sys

    from loongforge.bench.encode import (
        EncodeBenchSettings,
        format_report,
        run_encode_bench,
        summary_lines,
        write_doc,
    )

    with cli_errors():
        out = out or DEFAULT_OUT / "encode"
        result = run_encode_bench(out, data_root, EncodeBenchSettings(samples=samples, steps=steps), progress=progress)
        (out / "encode.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        report = format_report(result)
        (out / "encode.md").write_text(report + "\n")
        if doc is not None:
            write_doc(result, doc, "loongforge " + " ".join(sys.argv[1:]))
        typer.echo(report)
        for line in summary_lines(result):
            typer.echo(line)


@app.command("data")
def data(
    data_root: Annotated[Optional[Path], typer.Option(
        "--data-root", metavar="DIR", show_default=False,
        help="The shared data folder (coco2017/, mathvista/, arena_hard/, llamafactory/). "
             "Default: $LOONGFORGE_SHARED_DATA.")] = None,
    samples: Annotated[str, typer.Option(
        "--samples", metavar="100000,1000000", help="Input sizes, in samples.")] = "100000,1000000,10000000",
    baseline_max: Annotated[int, typer.Option(
        "--baseline-max", min=0, metavar="N",
        help="Largest size the in-memory reader runs at (its memory grows with the data).")] = 1_000_000,
    preset: Annotated[str, typer.Option(
        "--preset", "-p", metavar="NAME", help="Preset whose data settings and tokenizer are used.")]
        = "qwen2.5vl-7b",
    dp: Annotated[int, typer.Option("--dp", min=1, metavar="N", help="Rank processes per run.")] = 2,
    global_batch_size: Annotated[int, typer.Option(
        "--global-batch-size", min=1, metavar="ROWS", help="Rows of the first step.")] = 16,
    work: Annotated[Optional[Path], typer.Option(
        "--work", metavar="DIR", show_default=False,
        help="Where the generated inputs and Arrow copies go (removed after each size; the largest "
             "needs ~2x its JSONL size). Default: the output folder.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", show_default=False,
        help="Write data.md, data.json and data.png here. Default: outputs/bench/data/.")] = None,
) -> None:
    """Peak RSS per rank and time to first step at 100k-10M samples: Arrow reader vs the in-memory one."""
    import dataclasses
    import sys

    from loongforge.bench.chat_sets import REQUIRED
    from loongforge.bench.data import plot, report, run_data_bench
    from loongforge.bench.datasets import resolve_data_root

    with cli_errors():
        root = resolve_data_root(data_root, REQUIRED)
        if global_batch_size % dp:
            raise UsageError(f"--global-batch-size {global_batch_size} is not divisible by --dp {dp}")
        out = out or DEFAULT_OUT / "data"
        out.mkdir(parents=True, exist_ok=True)
        bench = run_data_bench(root, (work or out) / "work", sizes=tuple(_int_list(samples, "--samples")),
                               baseline_max=baseline_max, preset=preset, dp=dp,
                               global_batch_size=global_batch_size,
                               on_progress=lambda message: typer.echo(f"... {message}", err=True))
        plot(bench, out / "data.png")
        text = report(bench, "data.png", "loongforge " + " ".join(sys.argv[1:]))
        (out / "data.md").write_text(text)
        (out / "data.json").write_text(json.dumps(dataclasses.asdict(bench), indent=1) + "\n")
        typer.echo(text)
        typer.echo(f"wrote {out / 'data.md'}, {out / 'data.json'} and {out / 'data.png'}")
