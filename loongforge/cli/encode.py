"""``loongforge encode``: images and videos -> stored vision embeddings for training without the encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from loongforge.cli.errors import UsageError, cli_errors
from loongforge.cli.options import PresetOption, flag_option, inputs_argument, output_folder_option, progress_option, set_option
from loongforge.config.presets import DEFAULT_PRESET

InputsArgument = inputs_argument(
    "LLaVA/ShareGPT-style .json/.jsonl/.parquet conversation files or folders of them (what "
    "`train` reads), or one `loongforge pack` output folder. "
    "Mixture weights (FILE@WEIGHT) are accepted and ignored: every sample is encoded.")
OutputOption = output_folder_option("shards/, index.jsonl, rejects.jsonl, encoder.json")
ResumeOption = flag_option(
    "--resume", "Finish an interrupted encode into the same folder, with the same inputs and flags.")
OverwriteOption = flag_option("--overwrite", "Delete an earlier encode's output in --output first.")
SetOption = set_option("Config override, as for train (e.g. --set data.max_pixels=1003520); repeatable.")
ProgressOption = progress_option("A tqdm bar with media/s.")


def encode(
    inputs: InputsArgument,
    output: OutputOption,
    preset: PresetOption = None,
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", metavar="CKPT", show_default=False,
        help="Encoder weights from a loongforge checkpoint (a step_* folder or a checkpoint root: its latest).")] = None,
    hf: Annotated[Optional[Path], typer.Option(
        "--hf", metavar="HF_DIR", show_default=False,
        help="Encoder weights from a transformers checkpoint folder. Neither: the preset's initial weights "
             "(training.seed), as a run from scratch starts.")] = None,
    nproc_per_node: Annotated[int, typer.Option(
        "--nproc-per-node", min=1, metavar="N", help="Processes on this node, each with a whole encoder.")] = 1,
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="bf16|fp32",
        help="Encoder compute and storage precision. bf16 halves the store, but its rounded features are not the "
             "online encoder's: a run on them differs from the same run with the encoder online (frozen) by "
             "about 1e-5 relative in the loss; fp32 matches it to about 1e-7.")] = "bf16",
    device: Annotated[str, typer.Option(
        "--device", metavar="auto|cpu|cuda", help="auto: CUDA when available.")] = "auto",
    resume: ResumeOption = False,
    overwrite: OverwriteOption = False,
    shard_tokens: Annotated[int, typer.Option(
        "--shard-tokens", min=1, metavar="N", help="Embedding rows per shard (the unit --resume skips).")] = 65536,
    batch_patches: Annotated[int, typer.Option(
        "--batch-patches", min=1, metavar="N", help="Vision patches per encoder call (memory).")] = 16384,
    overrides: SetOption = None,
    progress: ProgressOption = True,
) -> None:
    """Run the vision encoder and merger once over every image and video of a dataset, and store the embeddings."""
    from loongforge.encode.job import EncodeOptions, run_encode

    with cli_errors():
        if checkpoint is not None and hf is not None:
            raise UsageError("--checkpoint and --hf both name encoder weights; pass one of them.")
        weights = checkpoint or hf
        summary = run_encode(EncodeOptions(
            inputs=tuple(str(p) for p in inputs), output=output, preset=preset or DEFAULT_PRESET,
            weights=str(weights) if weights else None, nproc=nproc_per_node, dtype=dtype, device=device,
            resume=resume, overwrite=overwrite, shard_tokens=shard_tokens, batch_patches=batch_patches,
            overrides=tuple(overrides or ()), progress=progress))
        typer.echo(summary.format())
