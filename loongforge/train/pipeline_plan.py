"""The pipeline in the plan: each stage's work per micro-batch, the predicted step and bubble, and the
layout with the smallest predicted step (``--dry-run --suggest-layout``).

Work: a stage's training FLOPs per micro-batch of one ``data.seq_len`` row, from the family's
``training_flops``: the language layers' share (the row's decoder FLOPs / num_layers each; a hybrid decoder's
layers each their own type's), the vision
encoder and projector on the first stage (a row whose image tokens fill ``IMAGE_SHARE`` of it, images
at ``data.max_pixels``), the LM head on the last (every token a loss token: the most it can cost).

Step: rank r runs its chunks' work ``T_r`` per micro-batch (VP chunks under the interleaved schedule).
With M micro-batches the schedule is bounded by the busiest rank in the steady state and by one pass
of a micro-batch through the chunks to fill and drain it:

    step = (M x VP - 1) x max_r T_r / VP + sum_r T_r / VP

For equal stages (T_r = T) the bubble, the share of rank-time without work, is then
(PP - 1) / (VP x M + PP - 1): 1F1B's (PP - 1) / (M + PP - 1) at VP 1, divided by about VP when
interleaved. Unequal stages add the busiest rank's excess on every micro-batch. The model leaves out
the messages between stages (VP times more of them when interleaved) and the gradient reduction.

Torch-free: a dry run builds no model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from loongforge.balance.cost_model import SampleCost
from loongforge.config.layout import derive_parallel_sizes
from loongforge.config.pipeline_layout import PipelineStages, layout_string, stage_plan
from loongforge.config.schema import RunConfig
from loongforge.config.validate import check_run_config
from loongforge.models.flops import FULL_ATTENTION, FlopOptions, StepFlops, with_layers
from loongforge.models.registry import get_family
from loongforge.train.context_plan import USABLE_SHARE
from loongforge.train.dry_run import GIB, activation_bytes, build_parallel_plan

IMAGE_SHARE = 0.5  # of a row's tokens, image tokens, for the encoder's work on the first stage
MAX_VIRTUAL = 8  # virtual stages per rank the suggestion tries


def equal_stage_bubble(pipeline: int, virtual: int, micro_batches: int) -> float:
    """The bubble of PP equal stages over M micro-batches, VP chunks per rank (1: 1F1B)."""
    return (pipeline - 1) / (virtual * micro_batches + pipeline - 1)


@dataclass(frozen=True)
class StageWork:
    """Training FLOPs per micro-batch of one row: ``per_layer`` for each language layer (``layers``: each
    layer's own, where they differ: a hybrid decoder's linear- and full-attention layers), ``encoder``
    (vision + projector) on the first stage, ``head`` on the last."""

    per_layer: float
    encoder: float
    head: float
    layers: tuple[float, ...] = ()

    def chunks(self, stages: PipelineStages) -> list[list[float]]:
        """FLOPs of every chunk: [PP][VP]."""
        last = (stages.pipeline - 1, stages.virtual - 1)
        return [[self._layers(stages, r, v) + (self.encoder if (r, v) == (0, 0) else 0.0)
                 + (self.head if (r, v) == last else 0.0) for v in range(stages.virtual)]
                for r in range(stages.pipeline)]

    def _layers(self, stages: PipelineStages, rank: int, chunk: int) -> float:
        count = stages.layers[rank][chunk]
        if not self.layers:
            return count * self.per_layer
        first = stages.first_layer(rank, chunk)
        return sum(self.layers[first:first + count])


@dataclass(frozen=True)
class PipelineTiming:
    step: float  # in the unit of the work (FLOPs: divide by a rate for seconds)
    bubble: float  # share of rank-time without work


def predicted_timing(chunk_work: list[list[float]], micro_batches: int) -> PipelineTiming:
    """The step and bubble of the schedule (module docstring) from each chunk's work [PP][VP]."""
    virtual = len(chunk_work[0])
    per_rank = [sum(row) for row in chunk_work]  # T_r
    step = ((micro_batches * virtual - 1) * max(per_rank) + sum(per_rank)) / virtual
    useful = micro_batches * sum(per_rank)
    return PipelineTiming(step=step, bubble=1.0 - useful / (len(per_rank) * step) if step else 0.0)


def row_work(cfg: RunConfig) -> StageWork:
    """The stages' work on one ``data.seq_len`` row (module docstring)."""
    model, data = cfg.model, cfg.data
    options = FlopOptions.from_training(cfg.training)
    grids = _row_images(cfg)
    patches = tuple(t * h * w for t, h, w in grids)
    row = [SampleCost(tokens=data.seq_len, patches=patches, loss_tokens=data.seq_len, grids=grids)]
    family = get_family(model.family)
    flops: StepFlops = family.training_flops(model, row, options)
    return StageWork(per_layer=flops.language / model.language.num_layers, encoder=flops.vision + flops.projector,
                     head=flops.lm_head, layers=_layer_flops(cfg, row, options))


def _layer_flops(cfg: RunConfig, row: list[SampleCost], options: FlopOptions) -> tuple[float, ...]:
    """Each decoder layer's FLOPs on ``row`` where the layers differ (a hybrid decoder's types, DeepSeek's
    dense first layers: the family's count of a one-layer model of each kind); () where every layer costs
    the same."""
    language = cfg.model.language
    dense_first = language.moe.first_dense_layers if language.moe else 0
    if not language.layer_types and not dense_first:
        return ()
    family = get_family(cfg.model.family)
    types = language.layer_types or [FULL_ATTENTION] * language.num_layers
    kinds = [(kind, index < dense_first) for index, kind in enumerate(types)]

    def one_layer(kind: str, dense: bool) -> float:
        single = with_layers(language, 1, first_dense=int(dense), layer_types=[kind] if language.layer_types else [],
                             mtp_num_layers=0)
        return family.training_flops(dataclasses.replace(cfg.model, language=single), row, options).language

    per_kind = {kind: one_layer(*kind) for kind in set(kinds)}
    return tuple(per_kind[kind] for kind in kinds)


def _row_images(cfg: RunConfig) -> tuple[tuple[int, int, int], ...]:
    """Square images at data.max_pixels whose tokens fill IMAGE_SHARE of the row (none for a text model)."""
    vision = cfg.model.vision
    if vision is None or cfg.data.vision_embeddings is not None:
        return ()
    merge = cfg.model.projector.spatial_merge_size
    side = max(merge, int(math.sqrt(cfg.data.max_pixels) / vision.patch_size) // merge * merge)
    tokens = side * side // (merge * merge)
    return ((1, side, side),) * max(1, int(IMAGE_SHARE * cfg.data.seq_len) // tokens)


# ------------------------------------------------------------------------------------ the report


def micro_batches_per_replica(cfg: RunConfig) -> int:
    return cfg.training.global_batch_size // derive_parallel_sizes(cfg.parallel).data_parallel


def schedule_name(virtual: int) -> str:
    return "1F1B" if virtual == 1 else f"interleaved 1F1B, {virtual} chunks per rank"


def pipeline_table(cfg: RunConfig) -> str:
    """Each stage's layers and work per micro-batch, and the predicted bubble (PP > 1)."""
    stages = stage_plan(cfg.model.language.num_layers, cfg.parallel)
    work = row_work(cfg)
    chunks = work.chunks(stages)
    micro_batches = micro_batches_per_replica(cfg)
    timing = predicted_timing(chunks, micro_batches)
    lines = [f"pipeline stages ({schedule_name(stages.virtual)}; per micro-batch of one {cfg.data.seq_len}-token "
             f"row, training FLOPs)", "  stage  rank  layers          TFLOP   holds"]
    last = (stages.pipeline - 1, stages.virtual - 1)
    for index, (rank, stage) in enumerate(stages.schedule_order()):
        count, first = stages.layers[rank][stage], stages.first_layer(rank, stage)
        layers = (f"{first}-{first + count - 1} ({count})" if count > 1 else f"{first} (1)") if count else "none"
        first_parts = "vision encoder + projector, embedding" if cfg.model.vision is not None else "embedding"
        holds = ", ".join(part for part, here in ((first_parts, (rank, stage) == (0, 0)),
                                                  ("LM head", (rank, stage) == last)) if here)
        lines.append(f"  {index:>5}  {rank:>4}  {layers:<14}  {chunks[rank][stage] / 1e12:>6.2f}   {holds}")
    even = equal_stage_bubble(stages.pipeline, stages.virtual, micro_batches)
    lines.append(f"  predicted bubble {100 * timing.bubble:.1f}% of the step over {micro_batches} micro-batches "
                 f"(equal stages would give {100 * even:.1f}%); the busiest rank "
                 f"{max(sum(row) for row in chunks) / 1e12:.2f} TFLOP per micro-batch")
    return "\n".join(lines)


@dataclass(frozen=True)
class LayoutCandidate:
    pipeline: int
    virtual: int
    layout: Optional[str]  # None: even stages
    micro_batches: int
    timing: PipelineTiming

    def overrides(self) -> list[str]:
        return [f"parallel.pipeline_model_parallel_size={self.pipeline}",
                f"parallel.virtual_pipeline_model_parallel_size={self.virtual if self.virtual > 1 else 'null'}",
                f"parallel.pipeline_layout={self.layout if self.layout else 'null'}"]


def suggest_layouts(cfg: RunConfig, *, gpu_memory_gib: float = 80.0, limit: int = 5) -> list[LayoutCandidate]:
    """Pipeline layouts at the run's world size (TP, CP and EP kept) that validate and fit
    ``gpu_memory_gib`` (as the dry run's CP table counts memory), smallest predicted step first:
    every PP (1: no pipeline), every VP up to MAX_VIRTUAL, even stages and the balanced uneven split
    of each."""
    budget = USABLE_SHARE * gpu_memory_gib * GIB
    work = row_work(cfg)
    candidates = []
    for pipeline, virtual in _pipeline_sizes(cfg):
        even = dataclasses.replace(cfg.parallel, pipeline_model_parallel_size=pipeline,
                                   virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
                                   pipeline_layout=None)
        layers = cfg.model.language.num_layers
        for layout in _layouts(layers, pipeline, virtual, work, cfg):
            parallel = dataclasses.replace(even, pipeline_layout=layout,
                                           virtual_pipeline_model_parallel_size=None if layout else
                                           even.virtual_pipeline_model_parallel_size)
            trial = dataclasses.replace(cfg, parallel=parallel)
            if check_run_config(trial, None, get_family(cfg.model.family).layout) or _memory(trial) > budget:
                continue
            stages = stage_plan(layers, parallel)
            micro_batches = micro_batches_per_replica(trial)
            candidates.append(LayoutCandidate(pipeline, virtual, layout, micro_batches,
                                              predicted_timing(work.chunks(stages), micro_batches)))
    return sorted(candidates, key=lambda c: (c.timing.step, c.pipeline, c.virtual))[:limit]


def _memory(cfg: RunConfig) -> float:
    """Bytes per rank on the busiest stage: weights, grads, optimizer state and activations."""
    return build_parallel_plan(cfg).memory_per_rank_bytes + activation_bytes(cfg, derive_parallel_sizes(cfg.parallel))


def _pipeline_sizes(cfg: RunConfig) -> list[tuple[int, int]]:
    parallel = cfg.parallel
    model_parallel = parallel.tensor_model_parallel_size * parallel.context_parallel_size
    ranks = parallel.world_size // model_parallel
    return [(pp, vp) for pp in range(1, ranks + 1) if ranks % pp == 0
            for vp in range(1, MAX_VIRTUAL + 1) if vp == 1 or pp > 1]


def _layouts(layers: int, pipeline: int, virtual: int, work: StageWork, cfg: RunConfig) -> list[Optional[str]]:
    """Even stages (None) where they divide, and the uneven split that evens the ranks' work."""
    stages = pipeline * virtual
    if layers < stages:
        return []
    out: list[Optional[str]] = [None] if layers % stages == 0 else []
    if pipeline == 1:
        return out
    uneven = balanced_stages(layers, pipeline, virtual, work, first_stage_min=_first_stage_min(cfg))
    text = layout_string(uneven, cfg.model.language.mtp_num_layers)
    if layers % stages or uneven != stage_plan(layers, dataclasses.replace(
            cfg.parallel, pipeline_model_parallel_size=pipeline, pipeline_layout=None,
            virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None)):
        out.append(text)
    return out


def _first_stage_min(cfg: RunConfig) -> int:
    vision = cfg.model.vision
    return len(vision.deepstack_layers) if vision is not None else 0


def balanced_stages(layers: int, pipeline: int, virtual: int, work: StageWork, *,
                    first_stage_min: int = 0) -> PipelineStages:
    """Layers per stage that minimise the busiest rank's work: start even (the remainder on the
    middle stages), then move one layer at a time from the busiest rank's largest stage to the least
    busy rank's smallest, while that lowers the maximum. Every stage keeps at least one layer, the
    first at least ``first_stage_min``."""
    order = [(r, v) for v in range(virtual) for r in range(pipeline)]
    counts = {stage: layers // len(order) for stage in order}
    for stage in sorted(order, key=lambda s: abs(order.index(s) - len(order) / 2))[:layers % len(order)]:
        counts[stage] += 1
    floor = {stage: max(1, first_stage_min if stage == (0, 0) else 1) for stage in order}

    def plan() -> PipelineStages:
        return PipelineStages(tuple(tuple(counts[(r, v)] for v in range(virtual)) for r in range(pipeline)))

    def busiest() -> float:
        return max(sum(row) for row in work.chunks(plan()))

    while True:
        loads = [sum(row) for row in work.chunks(plan())]
        source_rank, target_rank = loads.index(max(loads)), loads.index(min(loads))
        movable = [s for s in order if s[0] == source_rank and counts[s] > floor[s]]
        if source_rank == target_rank or not movable:
            return plan()
        source = max(movable, key=lambda s: counts[s])
        target = min((s for s in order if s[0] == target_rank), key=lambda s: counts[s])
        before = busiest()
        counts[source], counts[target] = counts[source] - 1, counts[target] + 1
        if busiest() >= before:
            counts[source], counts[target] = counts[source] + 1, counts[target] - 1
            return plan()


def suggestion_text(cfg: RunConfig, candidates: list[LayoutCandidate]) -> str:
    if not candidates:
        return (f"suggest-layout: no pipeline layout validates at {cfg.parallel.world_size} processes with "
                f"TP {cfg.parallel.tensor_model_parallel_size} x CP {cfg.parallel.context_parallel_size}")
    current = predicted_timing(row_work(cfg).chunks(stage_plan(cfg.model.language.num_layers, cfg.parallel)),
                               micro_batches_per_replica(cfg))
    lines = [f"suggest-layout (world {cfg.parallel.world_size}, TP {cfg.parallel.tensor_model_parallel_size}, "
             f"CP {cfg.parallel.context_parallel_size} kept; predicted step relative to this run's layout):",
             "    PP  VP  micro-batches  bubble  step   layout"]
    for c in candidates:
        lines.append(f"  {c.pipeline:>4}  {c.virtual:>2}  {c.micro_batches:>13}  {100 * c.timing.bubble:>5.1f}%  "
                     f"{c.timing.step / current.step:>4.2f}   {c.layout or 'even'}")
    best = candidates[0]
    lines.append(f"  this run: bubble {100 * current.bubble:.1f}%; best: run with {' '.join(best.overrides())}")
    return "\n".join(lines)
