"""Predictions of encoder sharing at full scale: ranks that split a row's language model evenly
either each encode all of its media or divide the media among them. ``parallel.encoder_dp=tp``
against ``none`` over a TP group (the cost model, real image mixes), and ``parallel.encoder_cp`` on
against off over a CP group (model FLOPs, a long-video row: ``predict_context_parallel``). Both are
one arithmetic (``GroupCost``): a rank's time is its language share plus the encoding it does.

One rank of a TP group spends on a micro-batch, as ``balance.cost_model`` splits the time:

- encoder: the vision terms (``sum_P2``, ``sum_P``, ``n_img``: ``train.balancing.VISION_TERMS``)
  of the images it encodes: with ``none`` at vision TP 1 every image of the micro-batch (each rank
  holds a whole encoder and repeats the work), with ``tp`` its share as ``parallel.media_assign``
  assigns it with the same coefficients (the slowest rank's share is what the step waits for);
- language model: the other terms (``sum_L2``, ``sum_L``, ``N``, ``n_loss``) divided by the TP
  size: TP splits the decoder's matmuls and attention heads evenly.

Not modelled (each named in the report): the language model's TP communication (the same in both
modes), the all-gather of the merged image embeddings and the once-per-step all-reduce of the
encoder's gradients over the TP group (``tp`` only), pipeline bubbles, and the vision-TP
alternative (``none`` at vision TP = TP divides the encoder's FLOPs as well, at the price of two
all-reduces per block and narrower matmuls, which a FLOP model cannot price).

Data: real image-size mixes, sized with the preset's tokenizer and image rules
(``bench.datasets``) and packed in file order into ``seq_len`` rows (next fit), so a row holds the
images that arrive together.

Under CP a rank holds 1/CP of the row's tokens (the causal load balance makes the attention even
too), so its language time is the row's language and LM-head FLOPs / CP; its encoder time is every
medium's vision and merger FLOPs with encoder_cp off, and with it on the slowest rank's share of
the frames as ``parallel.media_assign`` deals them (what loongforge trains: frames of a video are
independent in the tower, windows and full-attention blocks stay within a frame), beside the share
if each image and video went whole to one rank. Not modelled: the K/V all-gather of CP attention (the
same in both modes), the features' all-gather and their gradients' sum over CP (encoder_cp only).
Pure arithmetic on sizes: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from loongforge.balance.cost_model import LANGUAGE_TERMS, TERMS, CostModel, SampleCost, default_cost_model
from loongforge.bench.balance import load_pool
from loongforge.bench.datasets import (
    COCO_CAPTIONS,
    MATHVISTA,
    OMNIBAL,
    SampleSize,
    SampleSizer,
    coco_chats,
    mathvista_chats,
    omnibal_sizes,
)
from loongforge.bench.tables import markdown_table
from loongforge.config.loader import load_run_config
from loongforge.config.schema import ModelConfig
from loongforge.models.flops import FlopOptions, Grid
from loongforge.models.registry import get_family
from loongforge.parallel.media_assign import VisionCost, assign_media, deal, frame_costs
from loongforge.train.balancing import VISION_TERMS

PRESET = "qwen2.5vl-7b"
TENSOR_PARALLEL = 4


@dataclass
class Mix:
    name: str
    tokens: list  # LLM tokens per sample
    patches: list  # per sample, a tuple of vision patches per image
    loss_tokens: list  # per sample; 0 where the source does not say


def pack_rows(tokens: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row: next fit in order; samples longer than ``seq_len`` are left out."""
    rows, row, used = [], [], 0
    for index, length in enumerate(tokens):
        if length > seq_len:
            continue
        if used + length > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += length
    return rows + ([row] if row else [])


def vision_cost(model: CostModel) -> VisionCost:
    return VisionCost(*(model.coefficients[term] for term in VISION_TERMS))


def _language_cost(model: CostModel, mix: Mix, row: list[int]) -> float:
    coefficients = np.array([model.coefficients[t] if t in LANGUAGE_TERMS else 0.0 for t in TERMS])
    features = sum(SampleCost(mix.tokens[i], (), mix.loss_tokens[i]).features() for i in row)
    return float(np.dot(features, coefficients))


def _encoder_costs(media_costs: Sequence[float], owners: Sequence[int], ranks: int) -> tuple[float, float]:
    """(every medium on one rank, the slowest rank's share when ``ranks`` own them as ``owners`` says)."""
    loads = [0.0] * ranks
    for cost, owner in zip(media_costs, owners):
        loads[owner] += cost
    return float(sum(media_costs)), max(loads)


@dataclass
class GroupCost:
    """One rank's cost in a group of ranks that split the language model evenly: ``alone``, each
    rank encodes every medium; ``shared``, the ranks divide the media (the slowest rank's share).
    Any unit: only the ratios are reported."""

    encoder_alone: float
    encoder_shared: float
    language: float  # the rank's share of the language model (1 / group size of it)

    @property
    def encoder_share_alone(self) -> float:
        return self.encoder_alone / (self.encoder_alone + self.language)

    @property
    def encoder_ratio(self) -> float:
        return self.encoder_shared / self.encoder_alone

    @property
    def step_ratio(self) -> float:
        return (self.encoder_shared + self.language) / (self.encoder_alone + self.language)

    @property
    def gain(self) -> float:
        """Tokens per second per rank, shared against alone, less 1 (0.19: +19%)."""
        return 1 / self.step_ratio - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "encoder_share_alone": self.encoder_share_alone,
                "encoder_ratio": self.encoder_ratio, "step_ratio": self.step_ratio, "gain": self.gain}


@dataclass
class MixPrediction(GroupCost):
    """Per-rank cost summed over the mix's rows (a long run of steps), in the cost model's unit
    (seconds for the default model, FLOPs for ``flops_cost_model``): alone is ``encoder_dp=none``
    at vision TP 1, shared ``tp``."""

    name: str
    samples: int
    rows: int
    images_per_row: float
    patches_per_image: float


def predict_mix(mix: Mix, model: CostModel, *, group_size: int, seq_len: int) -> MixPrediction:
    """``group_size`` ranks (a TP group with encoder_dp, a CP group with encoder_cp) on every row."""
    cost = vision_cost(model)
    rows = pack_rows(mix.tokens, seq_len)
    encoder_alone = encoder_shared = language = 0.0
    images = patches = 0
    for row in rows:
        media = [p for i in row for p in mix.patches[i]]
        alone, shared = _encoder_costs([cost.of(p) for p in media], assign_media(media, group_size, cost), group_size)
        encoder_alone, encoder_shared = encoder_alone + alone, encoder_shared + shared
        language += _language_cost(model, mix, row) / group_size
        images, patches = images + len(media), patches + sum(media)
    return MixPrediction(name=mix.name, samples=sum(len(row) for row in rows), rows=len(rows),
                         images_per_row=images / max(len(rows), 1), patches_per_image=patches / max(images, 1),
                         encoder_alone=encoder_alone, encoder_shared=encoder_shared, language=language)


def flops_cost_model(model_cfg) -> CostModel:
    """Coefficients in FLOPs (training = 3 x forward) for any preset's shapes, as
    ``balance.cost_model.flops_model`` counts them but with the LM head priced on loss tokens only
    (``n_loss``): with a 152k vocabulary over a 128-wide decoder the head is most of a small
    language model, and it runs on the answer tokens alone. The merger runs once per merged
    token, so it adds 1 / merge^2 of its parameters per patch. Used for the CPU bench's own
    prediction; the 7B prediction keeps the documented default model."""
    counts = get_family(model_cfg.family).count_parameters(model_cfg)
    language, vision = model_cfg.language, model_cfg.vision
    head = language.vocab_size * language.hidden_size
    full_blocks = vision.depth if vision.window is None else vision.window.full_attention_blocks(vision.depth)
    merge_unit = model_cfg.projector.spatial_merge_size ** 2
    return CostModel({
        "sum_L2": 3 * 2 * language.hidden_size * language.num_layers,
        "sum_L": 6 * (counts["language_model"] - head),
        "N": 0.0,
        "sum_P2": 3 * 4 * vision.hidden_size * full_blocks,
        "sum_P": 6 * (counts["vision_model"] + counts["projector"] / merge_unit),
        "n_img": 0.0,
        "n_loss": 6 * head,
    }, units="flops", source="flops")


# ------------------------------------------------------------------------------------ the mixes


def _mix(name: str, sizes: Sequence) -> Mix:
    kept = [size for size in sizes if isinstance(size, SampleSize)]  # Rejects: what pack drops
    return Mix(name, [s.tokens for s in kept], [tuple(s.patches) for s in kept],
               [s.loss_tokens or 0 for s in kept])


def _whole_images(sizes: list[SampleSize]) -> list[SampleSize]:
    """OmniBal counts an image as InternVL 448-pixel tiles; Qwen2.5-VL encodes it whole, at
    native resolution: one medium of all its tiles' patches (full attention over all of them)."""
    return [SampleSize(s.tokens, (sum(s.patches),) if s.patches else (), s.loss_tokens) for s in sizes]


def load_mixes(data_root: Path, preset: str = PRESET) -> list[Mix]:
    """COCO captions (photos <= 640 px: low variance), MathVista testmini (up to 5236 px: the heavy
    tail, capped by the preset's max_pixels) and the four OmniBal sets (documents, charts)."""
    sizer = SampleSizer(preset)
    mixes = [_mix("COCO captions", sizer.size_chats(coco_chats(data_root / COCO_CAPTIONS), "coco")),
             _mix("MathVista testmini", sizer.size_chats(mathvista_chats(data_root / MATHVISTA), "mathvista"))]
    for path in sorted((data_root / OMNIBAL).glob("*.csv")):
        name = "OmniBal " + path.stem.removeprefix("omnibal_internvl_")
        mixes.append(_mix(name, _whole_images(omnibal_sizes(path))))
    return mixes


def predict_conversations(path: Path, preset: str, *, group_size: int, seq_len: int) -> MixPrediction:
    """The same arithmetic on a conversation file at a preset's own shapes (``flops_cost_model``)."""
    pool = load_pool([path], preset=preset, seq_len=seq_len)
    mix = Mix(Path(path).name, pool.tokens, pool.patches, [n or 0 for n in pool.loss])
    return predict_mix(mix, flops_cost_model(load_run_config(preset).model), group_size=group_size, seq_len=seq_len)


def predict(data_root: Path, *, model: Optional[CostModel] = None, preset: str = PRESET,
            tensor_parallel: int = TENSOR_PARALLEL, seq_len: Optional[int] = None) -> list[MixPrediction]:
    model = model or default_cost_model()
    seq_len = seq_len or load_run_config(preset).data.seq_len
    return [predict_mix(mix, model, group_size=tensor_parallel, seq_len=seq_len)
            for mix in load_mixes(data_root, preset)]


def format_predictions(predictions: Sequence[MixPrediction]) -> str:
    header = ["image mix", "rows", "images per row", "patches per image", "encoder share of a rank's time (none)",
              "encoder time tp / none (slowest rank)", "step time tp / none", "step speed-up"]
    return markdown_table(header, "lrrrrrrr", (
        [p.name, p.rows, f"{p.images_per_row:.1f}", f"{p.patches_per_image:,.0f}", f"{100 * p.encoder_share_alone:.0f}%",
         f"{p.encoder_ratio:.3f}", f"{p.step_ratio:.3f}", f"{1 / p.step_ratio:.2f}x"] for p in predictions))


# ------------------------------------------------------------------------------------ CP, long video

CONTEXT_PARALLEL_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class LongVideoRow:
    """One packed row of ``tokens``, a video among them as ``clips`` equal clips of its frames."""

    name: str
    tokens: int = 32768
    # (t, h, w) patches of the whole video: 64 temporal patches (128 frames at temporal patch 2) of
    # 448 x 448 pixels (32 x 32 patches of 14): 65,536 patches, 16,384 merged tokens.
    video_grid: Grid = (64, 32, 32)
    clips: int = 1
    loss_tokens: int = 2048  # the answer; the rest of the row is prompt and the video

    def grids(self) -> list[Grid]:
        t, h, w = self.video_grid
        if t % self.clips:
            raise ValueError(f"{self.name}: {t} temporal patches do not split into {self.clips} equal clips")
        return [(t // self.clips, h, w)] * self.clips


# One video is one medium: dealt whole it lands on one rank, as clips or as frames it divides.
LONG_VIDEO_ROWS = (LongVideoRow("one 16k-token video"), LongVideoRow("the same video as 4 clips", clips=4),
                   LongVideoRow("the same video as 16 clips", clips=16))


@dataclass
class ContextParallelPrediction:
    row: str
    context_parallel: int
    whole_media: GroupCost  # each image and video whole on one rank, dealt by modelled cost
    frames: GroupCost  # encoder_cp as loongforge trains it: frames dealt by modelled cost


def _medium_flops(model_cfg: ModelConfig, grid: Grid, options: FlopOptions) -> float:
    """The vision tower's and merger's training FLOPs on one image or video."""
    t, h, w = grid
    flops = get_family(model_cfg.family).training_flops(
        model_cfg, [SampleCost(tokens=0, patches=(t * h * w,), grids=(grid,))], options)
    return flops.vision + flops.projector


def predict_context_parallel(model_cfg: ModelConfig, row: LongVideoRow, context_parallel: int, *,
                             options: FlopOptions = FlopOptions(),
                             cost: Optional[VisionCost] = None) -> ContextParallelPrediction:
    """One rank's training FLOPs on ``row`` at CP ``context_parallel``, encoder_cp off against on.
    ``cost``: what ``parallel.media_assign`` deals media by (default: the default cost model's)."""
    grids = row.grids()
    patches = [t * h * w for t, h, w in grids]
    frames = [t for t, _, _ in grids]
    whole_row = get_family(model_cfg.family).training_flops(
        model_cfg, [SampleCost(tokens=row.tokens, patches=tuple(patches), loss_tokens=row.loss_tokens,
                               grids=tuple(grids))], options)
    language = (whole_row.language + whole_row.lm_head) / context_parallel
    cost = cost or vision_cost(default_cost_model())
    media = [_medium_flops(model_cfg, grid, options) for grid in grids]
    alone, whole_shared = _encoder_costs(media, assign_media(patches, context_parallel, cost), context_parallel)
    frame_flops = [flops / t for flops, t in zip(media, frames) for _ in range(t)]
    frame_owners = deal(frame_costs(patches, frames, cost), context_parallel)
    _, frames_shared = _encoder_costs(frame_flops, frame_owners, context_parallel)
    return ContextParallelPrediction(row=row.name, context_parallel=context_parallel,
                                     whole_media=GroupCost(alone, whole_shared, language),
                                     frames=GroupCost(alone, frames_shared, language))


def predict_long_video(preset: str = PRESET, rows: Sequence[LongVideoRow] = LONG_VIDEO_ROWS,
                       sizes: Sequence[int] = CONTEXT_PARALLEL_SIZES) -> list[ContextParallelPrediction]:
    """Every row at every CP size, with the preset's model and training options (recompute, frozen parts)."""
    cfg = load_run_config(preset)
    options = FlopOptions.from_training(cfg.training)
    return [predict_context_parallel(cfg.model, row, cp, options=options) for row in rows for cp in sizes]


def _gain(value: float) -> str:
    return f"{100 * value:+.0f}%"


def format_context_parallel(predictions: Sequence[ContextParallelPrediction]) -> str:
    rows = ["| row | CP | encoder share of a rank's time (off) | step time on / off, frames dealt (loongforge) | "
            "gain | step time on / off, whole media dealt | gain |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p in predictions:
        whole, frames = p.whole_media, p.frames
        rows.append(f"| {p.row} | {p.context_parallel} | {100 * whole.encoder_share_alone:.0f}% | "
                    f"{frames.step_ratio:.3f} | {_gain(frames.gain)} | {whole.step_ratio:.3f} | {_gain(whole.gain)} |")
    return "\n".join(rows)
