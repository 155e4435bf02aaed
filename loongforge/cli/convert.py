"""``loongforge convert``: HF <-> megatron-core checkpoints, the round-trip check through a sharded
megatron checkpoint, and the logits check of the family's model against transformers."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from loongforge.cli.errors import FAILURE_EXIT_CODE, UsageError, cli_errors
from loongforge.cli.options import flag_option, optional_option

# Same flag as `train --preset`, but here it only checks: the model is read from SRC itself.
PresetOption = Annotated[Optional[str], typer.Option(
    "--preset", "-p", metavar="NAME", show_default=False,
    help="Check SRC against this preset's model (shapes and config); needed for a checkpoint without "
         "its run's config.yaml or HF config beside it. With --to hf and no run config.yaml, its data "
         "settings size the processor files written.")]
SrcArgument = Annotated[Path, typer.Argument(
    metavar="SRC", show_default=False,
    help="HF folder (config.json + safetensors) or a loongforge checkpoint (step folder or run checkpoint root).")]
DstArgument = Annotated[Optional[Path], typer.Argument(
    metavar="DST", show_default=False, help="Output folder (written beside it, renamed at the end).")]
ToOption = optional_option(str, "--to", "mcore|hf", "Target format.")
TpOption = Annotated[int, typer.Option("--tp", min=1, metavar="N", help=(
    "Language tensor-parallel size to check and pad the vocabulary for; --roundtrip writes its shards, "
    "--check-logits runs the model at it (N gloo processes)."))]
PpOption = Annotated[int, typer.Option("--pp", min=1, metavar="N", help="Pipeline-parallel size to check.")]
VpOption = optional_option(
    int, "--vp", "N", "Virtual pipeline stages per rank to check (parallel.virtual_pipeline_model_parallel_size).",
    min=1)
PipelineLayoutOption = optional_option(
    str, "--pipeline-layout", "LAYOUT",
    "Layers per pipeline stage to check, as parallel.pipeline_layout (e.g. 'Et|ttt|ttt|tL').")
VisionTpOption = optional_option(
    int, "--vision-tp", "N",
    "Vision tensor-parallel size (default: --tp); --roundtrip writes its shards, --check-logits runs at it.", min=1)
DtypeOption = optional_option(str, "--dtype", "bf16|fp16|fp32", "Cast every tensor (default: keep the source's).")
MaxShardOption = optional_option(
    str, "--max-shard-size", "SIZE",
    "Largest HF safetensors shard, e.g. 5GB, 500MB (default: the files of the HF folder converted from, else 5GB).")
OverwriteOption = flag_option("--overwrite", "Replace DST if it exists.")
VerifyOption = flag_option("--verify", "Re-read DST and compare every tensor with SRC.")
RoundtripOption = flag_option(
    "--roundtrip", "HF -> megatron -> HF through a torch_dist checkpoint written as the --tp/--vision-tp ranks "
    "write it, in a temporary folder as large as the model (removed afterwards); table per tensor, exit 1 unless "
    "exact.")
CheckLogitsOption = flag_option(
    "--check-logits", "Run SRC in transformers and in loongforge's own model (fp32, at --tp) on one built-in chat "
    "(with an image for a vision model) and compare the logits; exit 1 unless the max abs difference <= --atol. "
    "A loongforge checkpoint is first written as HF to a temporary folder.")
ImageOption = optional_option(
    Path, "--image", "PATH",
    "With --check-logits: this picture instead of the built-in one (sized and patchified as training does).")
AtolOption = optional_option(
    float, "--atol", "X", "With --check-logits: the largest logit difference that passes (default: 1e-4, for fp32).",
    min=0.0)
JsonOption = flag_option("--json", "With --roundtrip or --check-logits: print the report as one JSON object.")
NoProgressOption = flag_option("--no-progress", "No progress bar.")
AdapterOption = Annotated[bool, typer.Option(
    "--adapter", help="With --to hf, a LoRA run's checkpoint: write its adapters as a PEFT folder "
                      "(adapter_config.json + adapter_model.safetensors) instead of the merged model.")]


class _Interrupted(BaseException):
    """Raised in the main thread by SIGINT / SIGTERM. A BaseException, so that no ``except
    Exception`` on the way up swallows it; the staging folder's cleanup still runs."""


@contextlib.contextmanager
def _exit_cleanly_on_signals() -> Iterator[None]:
    """SIGINT / SIGTERM unwind the conversion (removing its staging folder), then one line and
    exit 128 + signal (130, 143), the shell's convention for a process ended by a signal."""
    received: list[int] = []

    def handler(signum, _frame) -> None:
        if not received:  # a second Ctrl-C must not interrupt the cleanup of the first
            received.append(signum)
            raise _Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except BaseException:
        if not received:
            raise
        # torch.distributed.checkpoint re-raises a writer's exception wrapped in its own: the
        # signal, not the exception type, says the run was interrupted.
        typer.echo(f"error: convert interrupted by {signal.Signals(received[0]).name}; "
                   "its partial output was removed", err=True)
        raise typer.Exit(128 + received[0]) from None
    finally:
        for signum, old_handler in previous.items():
            signal.signal(signum, old_handler)


def convert(
    src: SrcArgument,
    dst: DstArgument = None,
    to: ToOption = None,
    preset: PresetOption = None,
    tp: TpOption = 1,
    pp: PpOption = 1,
    vp: VpOption = None,
    pipeline_layout: PipelineLayoutOption = None,
    vision_tp: VisionTpOption = None,
    dtype: DtypeOption = None,
    max_shard_size: MaxShardOption = None,
    overwrite: OverwriteOption = False,
    verify: VerifyOption = False,
    roundtrip: RoundtripOption = False,
    check_logits: CheckLogitsOption = False,
    image: ImageOption = None,
    atol: AtolOption = None,
    json_output: JsonOption = False,
    no_progress: NoProgressOption = False,
    adapter: AdapterOption = False,
) -> None:
    """Convert checkpoints of any model family between Hugging Face and megatron-core (any TP/PP), streamed."""
    with _exit_cleanly_on_signals(), cli_errors():
        if not check_logits and (image is not None or atol is not None):
            raise UsageError("--image and --atol go with --check-logits")
        if check_logits:
            if (roundtrip or dst is not None or to is not None or dtype is not None or pp != 1 or vp is not None
                    or pipeline_layout is not None):
                raise UsageError("--check-logits takes SRC only (with --tp, --vision-tp, --image, --atol, --preset); "
                                 "drop DST, --to, --dtype, --pp, --vp, --pipeline-layout and --roundtrip")
            _check_logits(src, preset, tp, vision_tp, image, atol, json_output, no_progress)
            return
        if roundtrip:
            _roundtrip(src, dst, to, tp, pp, vision_tp, json_output, no_progress, vp=vp, pipeline_layout=pipeline_layout)
            return
        if dst is None or to is None:
            raise UsageError("convert needs SRC DST --to mcore|hf (or SRC --roundtrip)")
        if dtype is not None and dtype not in ("bf16", "fp16", "fp32"):
            raise UsageError(f"--dtype={dtype} must be bf16, fp16 or fp32")
        from loongforge.convert.engine import convert as run_convert
        from loongforge.convert.hf_io import parse_size

        try:
            shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
        except ValueError as exc:
            raise UsageError(f"--max-shard-size: {exc}") from None
        if adapter and to != "hf":
            raise UsageError("--adapter writes a LoRA run's adapters from its checkpoint: use it with --to hf")
        options = {"adapter": True} if adapter else {}
        report = run_convert(src, dst, to=to, preset=preset, tp=tp, pp=pp, vision_tp=vision_tp, vp=vp,
                             pipeline_layout=pipeline_layout, dtype=dtype,
                             max_shard_size=shard_bytes, overwrite=overwrite, verify=verify,
                             progress=not no_progress, **options)
        typer.echo(report.summary())
        if report.verify_mismatches:
            raise typer.Exit(FAILURE_EXIT_CODE)


def _roundtrip(src, dst, to, tp, pp, vision_tp, json_output, no_progress, *, vp, pipeline_layout) -> None:
    if dst is not None or to is not None:
        raise UsageError("--roundtrip takes SRC only (it writes only a temporary copy); drop DST and --to")
    from loongforge.convert.roundtrip import roundtrip

    report = roundtrip(src, tp=tp, pp=pp, vision_tp=vision_tp, vp=vp, pipeline_layout=pipeline_layout,
                       progress=not no_progress and not json_output)
    typer.echo(json.dumps(report.to_json()) if json_output else report.table())
    if not report.exact:
        raise typer.Exit(FAILURE_EXIT_CODE)


def _check_logits(src, preset, tp, vision_tp, image, atol, json_output, no_progress) -> None:
    from loongforge.convert.check_logits import DEFAULT_ATOL, check_logits

    quiet = no_progress or json_output
    report = check_logits(src, image=image, tp=tp, vision_tp=vision_tp,
                          atol=DEFAULT_ATOL if atol is None else atol, preset=preset,
                          say=(lambda message: None) if quiet else (lambda message: typer.echo(message, err=True)),
                          progress=not quiet)
    typer.echo(json.dumps(report.to_json()) if json_output else report.text())
    if not report.passed:
        raise typer.Exit(FAILURE_EXIT_CODE)
