"""``loongforge bench context-parallel --doc``: docs/benchmarks/context_parallel.md, the measured CPU
figures of ``parallel.encoder_cp`` on and off beside the FLOP prediction for Qwen2.5-VL-7B on a
long-video row and NeMo AutoModel's published figure. Formatting only: the numbers come from
``bench.context_parallel`` (runs) and ``bench.encoder_dp_predict`` (model)."""

from __future__ import annotations

from typing import Sequence

import torch

from loongforge.bench.context_parallel import GRID, LAYOUTS, SAMPLE_MULTIPLE
from loongforge.bench.encoder_dp_predict import PRESET as PREDICT_PRESET
from loongforge.bench.encoder_dp_predict import (
    ContextParallelPrediction,
    LongVideoRow,
    MixPrediction,
    format_context_parallel,
)
from loongforge.bench.train_grid import PRESET, GridBench, measured_section
from loongforge.config.loader import load_run_config

# NVIDIA NeMo AutoModel PR #2990 (frame-level CP vision-tower sharding): "about +19% tokens/sec per
# GPU" against every CP rank running the whole tower.
NEMO_AUTOMODEL_GAIN = 0.19
# A measured encoder ratio under this share of the FLOP ratio is worth a sentence in the document.
BELOW_PREDICTION = 0.9
NEMO_AUTOMODEL_LINE = (f"NVIDIA NeMo AutoModel PR #2990 (frame-level CP vision-tower sharding, measured on GPUs): "
                       f"about +{100 * NEMO_AUTOMODEL_GAIN:.0f}% tokens/s per GPU")


def _setup() -> str:
    return (f"- TP 1, DP 1, a whole encoder on every rank. Every sample is padded to a multiple of "
            f"{SAMPLE_MULTIPLE} tokens (`data.sample_multiple`, 2 x the largest CP) in both layouts, so CP 2 "
            "and CP 4 train the same rows; each CP rank holds 1 / CP of a row's tokens.")


def _headline(bench: GridBench) -> str:
    lines = []
    for layout in LAYOUTS:
        on = bench.comparison(layout, "on")
        if on is not None:
            lines.append(f"- {LAYOUTS[layout].label}: encoder time of the slowest rank, on / off: "
                         f"**{on.encoder_ratio:.2f}** (mean rank {on.mean_encoder_ratio:.2f}); step CPU time "
                         f"{on.step_cpu_ratio:.2f}, step wall time {on.step_ratio:.2f}; the largest peak memory "
                         f"of a rank {on.memory_ratio:.2f}.")
    return "\n".join(lines)


def _side_by_side(bench: GridBench, cpu_predictions: Sequence[MixPrediction]) -> str:
    """Measured against the same arithmetic on the bench's own chats (``cpu_predictions``: one per
    layout, in ``LAYOUTS`` order)."""
    rows = ["| layout | encoder share of a rank's time (off) | encoder time on / off | step time on / off |",
            "|---|---:|---:|---:|"]
    for layout, predicted in zip(LAYOUTS, cpu_predictions):
        on, off = bench.comparison(layout, "on"), bench.comparison(layout, "off")
        if on is None or off is None:
            continue
        rows.append(f"| {LAYOUTS[layout].label}, measured | {100 * off.run.slowest_encoder_share:.0f}% (CPU) | "
                    f"{on.encoder_ratio:.2f} | {on.step_ratio:.2f} wall, {on.step_cpu_ratio:.2f} CPU |")
        rows.append(f"| {LAYOUTS[layout].label}, predicted (FLOPs) | {100 * predicted.encoder_share_alone:.0f}% | "
                    f"{predicted.encoder_ratio:.2f} | {predicted.step_ratio:.2f} |")
    return "\n".join(rows)


def _below_prediction(bench: GridBench, cpu_predictions: Sequence[MixPrediction]) -> str:
    """A sentence for each layout whose measured encoder ratio is well below its FLOP ratio."""
    notes = []
    for layout, predicted in zip(LAYOUTS, cpu_predictions):
        on = bench.comparison(layout, "on")
        if on is not None and on.encoder_ratio < BELOW_PREDICTION * predicted.encoder_ratio:
            notes.append(f"At {LAYOUTS[layout].name} the measured encoder ratio ({on.encoder_ratio:.2f}) is below the "
                         f"FLOP ratio ({predicted.encoder_ratio:.2f}), though a photo's FLOPs are the same in both "
                         "modes: here a process that encoded more photos, holding more activations (the memory "
                         "column), spent more CPU seconds on each; this bench does not isolate why (memory traffic, "
                         "page faults and the other processes on the two cores all count in a process's CPU time).")
    return " ".join(notes)


def _assumptions(rows: Sequence[LongVideoRow]) -> str:
    cfg = load_run_config(PREDICT_PRESET)
    row = rows[0]
    t, h, w = row.video_grid
    merge = cfg.model.projector.spatial_merge_size
    pixels = h * cfg.model.vision.patch_size
    return "\n".join([
        f"- Model: the `{PREDICT_PRESET}` preset's shapes, FLOPs from its family's `training_flops` "
        "(its vision tower's FLOP count with the shared decoder's: windowed and "
        "full-attention vision blocks over each frame, the "
        "merger, the decoder over the packed row with full-square attention, the LM head on the loss "
        f"tokens), training options as the preset sets them (recompute "
        f"{'on' if cfg.training.recompute_activations else 'off'}).",
        f"- Row: {row.tokens:,} tokens, of which a video of {t * cfg.model.vision.temporal_patch_size} frames "
        f"at {pixels} x {pixels} pixels ({t} x {h} x {w} = {t * h * w:,} patches, {t * h * w // merge ** 2:,} "
        f"merged tokens); {row.loss_tokens:,} loss tokens. The rows below cut the same video into equal clips.",
        "- A rank's time: the row's language and LM-head FLOPs / CP (the causal load balance gives every CP "
        "rank an even share of the attention too), plus its encoder FLOPs: every medium with encoder_cp "
        "off; with it on, the slowest rank's share of the frames as `parallel.media_assign` deals them "
        "(what loongforge trains: a video's frames are independent in the tower), beside the share if each "
        "image and video went whole to one rank.",
        "- Not modelled: the K/V all-gather of CP attention (the same in both modes), the all-gather of "
        "the merged features and the sum of their gradients over CP (encoder_cp only; a few MB per "
        "row), the vision tower's lower efficiency per FLOP on a GPU (narrow matmuls, small windows), "
        "the optimizer step.",
    ])


def _reference(predictions: Sequence[ContextParallelPrediction], rows: Sequence[LongVideoRow]) -> str:
    """NeMo AutoModel's figure beside this report's CP 2 prediction on the first row, and what differs."""
    cp2 = next((p for p in predictions if p.context_parallel == 2 and p.row == rows[0].name), None)
    here = (f"{100 * cp2.frames.gain:+.0f}% as loongforge deals frames ({100 * cp2.whole_media.gain:+.0f}% if "
            "the video went whole to one rank)" if cp2 else "not computed")
    return (
        f"Reference: **{NEMO_AUTOMODEL_LINE}**, against every CP rank running the whole tower, with lower "
        f"peak memory and a bit-identical step-0 loss. Predicted here for CP 2 on `{rows[0].name}`: {here}. "
        "What differs: (1) it is a measurement on GPUs of NeMo's own recipes (the PR's CP 2 examples are "
        "Qwen3.5-4B and Qwen3-VL-8B) on their rows, whose vision share this report does not know, not a FLOP "
        "count of Qwen2.5-VL-7B on this row; (2) its tower ran under activation checkpointing (a second "
        "vision forward in the backward, which sharing divides too), while the 7B preset here trains without "
        "recompute; (3) a measured step prices the tower's efficiency per FLOP, lower than the decoder's on "
        "a GPU, which can make its share of the time larger than its share of the FLOPs. Both divide a video "
        "by frames; dealing whole media instead, a row whose media is one long video would gain nothing "
        f"(the `{rows[0].name}` rows' last column) until the video arrived as clips.")


def format_doc(bench: GridBench, predictions: Sequence[ContextParallelPrediction], rows: Sequence[LongVideoRow],
               cpu_predictions: Sequence[MixPrediction], *, command_line: Sequence[str]) -> str:
    """The whole document. ``predictions``: the 7B long-video rows (``rows``) at each CP size;
    ``cpu_predictions``: the same arithmetic on the bench's own chats, one per layout."""
    return "\n".join([
        "# Context parallelism with the vision encoder shared (`parallel.encoder_cp`): measured on CPU, "
        "predicted at 7B",
        "",
        "Generated by",
        "```",
        " ".join(command_line),
        "```",
        "(`loongforge bench context-parallel --doc FILE`; the runs and their metrics stay under the bench's "
        "`--out`, default `outputs/bench/context_parallel/`).",
        "",
        "`off` (`parallel.encoder_cp=false`): every rank of a CP group runs the whole vision encoder on every "
        "photo of the row they share. `on` (the default): the CP group divides the row's images and videos "
        "by modelled cost (`parallel.media_assign`), each rank encodes its share, the merged features are "
        "gathered, and each feature's gradient, summed over the CP group, returns to the rank that encoded "
        "it (`models/vlm/encoder_share.py`).",
        "",
        *measured_section(bench, GRID, [_setup()]),
        "",
        _headline(bench),
        "",
        "Memory: both modes keep a whole encoder, its gradients and its optimizer state on every rank; `on` "
        "saves the activations of the photos a rank no longer encodes.",
        "",
        f"Side by side with the same FLOP arithmetic on the bench's own chats at the `{PRESET}` shapes "
        "(`bench.encoder_dp_predict.predict_conversations`, FLOP-count coefficients); what the measured step "
        "keeps beyond it is work no FLOP term covers (the optimizer step, per-step overhead), the same in "
        "both modes:",
        "",
        _side_by_side(bench, cpu_predictions),
        "",
        _below_prediction(bench, cpu_predictions),
        "",
        "## Predicted: Qwen2.5-VL-7B, one long-video row at CP 2, 4, 8",
        "",
        _assumptions(rows),
        "",
        format_context_parallel(predictions),
        "",
        "Gain: tokens per second per rank, on against off (1 / step-time ratio, less 1).",
        "",
        _reference(predictions, rows),
        "",
        f"Versions: torch {torch.__version__}.",
        "",
    ])
