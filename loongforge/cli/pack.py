"""``loongforge pack``: conversation files -> packed shards + manifest + stats + rejects."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from loongforge.cli.errors import cli_errors
from loongforge.cli.options import PresetOption, flag_option, inputs_argument, output_folder_option, progress_option, set_option
from loongforge.config.presets import DEFAULT_PRESET

InputsArgument = inputs_argument(
    "Data files (.json/.jsonl/.parquet records: conversations, Alpaca, image-caption pairs, "
    "{\"text\"} documents; .txt: one document per line), or folders of .json/.jsonl/.parquet files. "
    "FILE@WEIGHT on every input packs a weighted mixture (docs/data.md).")
OutputOption = output_folder_option("shards/, manifest.jsonl, stats.json, rejects.jsonl")
GroupByMediaOption = flag_option("--group-by-media", "Keep text-only, image and video samples in separate packs.")
ResumeOption = flag_option(
    "--resume", "Continue an interrupted pack into the same folder, with the same inputs and flags.")
SetOption = set_option("Config override on top of the preset, as for train (e.g. --set data.max_pixels=1003520, "
                       "a model.vision.* setting); repeatable. Training must use the same.")
ProgressOption = progress_option("tqdm bars per stage.")


def pack(
    inputs: InputsArgument,
    output: OutputOption,
    seq_len: Annotated[int, typer.Option(
        "--seq-len", min=1, metavar="N", show_default=False,
        help="Tokens per pack: the training data.seq_len. Longer samples are rejected (too_long); "
             "longer pretraining documents are cut into pieces.")],
    preset: PresetOption = None,
    algorithm: Annotated[str, typer.Option(
        "--algorithm", metavar="bfd|ffd|balanced",
        help="best-fit decreasing; first-fit decreasing; or bfd then evening out sum(L^2) across packs.")] = "bfd",
    workers: Annotated[int, typer.Option(
        "--workers", min=1, metavar="N", help="Processes for the scan and write stages.")] = 1,
    max_images_per_pack: Annotated[Optional[int], typer.Option(
        "--max-images-per-pack", min=1, metavar="N", show_default=False,
        help="At most N images+videos in one pack. Default: no limit.")] = None,
    group_by_media: GroupByMediaOption = False,
    resume: ResumeOption = False,
    packs_per_shard: Annotated[int, typer.Option(
        "--packs-per-shard", min=1, metavar="N", help="Packs per parquet shard (the unit --resume skips).")] = 256,
    overrides: SetOption = None,
    progress: ProgressOption = True,
    record_kind: Annotated[str, typer.Option(
        "--record-kind", metavar="auto|conversation|text|alpaca|caption",
        help="data.record_kind: auto recognises each record by its fields.")] = "auto",
    caption_prompt: Annotated[Optional[str], typer.Option(
        "--caption-prompt", metavar="TEXT", show_default=False,
        help="data.caption_prompt: user text after the image of caption records.")] = None,
    context_parallel: Annotated[int, typer.Option(
        "--context-parallel", min=1, metavar="K",
        help="Pack for parallel.context_parallel_size=K: each sample counted at its length padded to a "
             "multiple of 2K, as training pads it (--seq-len must be a multiple of 2K).")] = 1,
) -> None:
    """Pack data files offline into fixed-capacity packs with per-sample cost metadata."""
    from loongforge.pack.job import PackOptions, run_pack

    with cli_errors():
        summary = run_pack(PackOptions(
            inputs=tuple(str(p) for p in inputs), output=output, preset=preset or DEFAULT_PRESET, seq_len=seq_len,
            algorithm=algorithm, workers=workers, max_images_per_pack=max_images_per_pack,
            group_by_media=group_by_media, resume=resume, packs_per_shard=packs_per_shard, progress=progress,
            record_kind=record_kind, caption_prompt=caption_prompt, context_parallel=context_parallel,
            overrides=tuple(overrides or ())))
        typer.echo(summary.format())
