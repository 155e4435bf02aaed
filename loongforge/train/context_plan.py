"""Context parallelism in ``--dry-run``: per-rank memory at CP 1-16, the CP a sequence length needs
(``--fit-seq-len``), and what ``parallel.encoder_cp`` is predicted to save there.

Pure arithmetic over a validated RunConfig, like ``dry_run``. Each CP size is the run's config at that
CP and sequence length, checked by the config's own rules (``check_run_config``) and priced by
``dry_run``'s memory model: weights, grads and optimizer state (sharded over DP x CP, so constant in
CP at a fixed world size) plus the activations of a rank's seq_len / CP tokens. A CP size whose
TP x PP x CP group does not divide the run's world size is priced at the smallest world that holds
it: what the run would need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from loongforge.balance.cost_model import (
    LANGUAGE_TERMS,
    QWEN2_5_VL_7B_H100,
    CostModel,
    SampleCost,
    encoder_cp_gain,
    flops_model,
    with_vision_spread,
)
from loongforge.config.layout import ParallelSizes, derive_parallel_sizes
from loongforge.config.schema import SUGGESTED_LOSS_CHUNK_TOKENS, DataConfig, ModelConfig, RunConfig
from loongforge.config.validate import check_run_config
from loongforge.train.dry_run import (
    GIB,
    activation_bytes,
    build_parallel_plan,
    layout_label,
    lm_head_activation_bytes,
    split_parameters,
)

CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8, 16)
# The full-size presets are sized for 80 GB GPUs (H100, A100 80GB); --gpu-memory-gib for others.
GPU_MEMORY_GIB = 80.0
# The share of it a plan may fill: the rest is the CUDA context, NCCL's buffers and the allocator's
# fragmentation, which the memory model does not count.
USABLE_SHARE = 0.9
# The encoder_cp line's FLOP model runs at the documented default's achieved throughput: the gain
# is a ratio and does not depend on it, the seconds do.
ACHIEVED_FLOPS_PER_S = QWEN2_5_VL_7B_H100["achieved_flops_per_s"]


@dataclass(frozen=True)
class ContextOption:
    """The run at one CP size: its config (CP, world, seq_len), sizes and memory per rank."""

    cfg: RunConfig
    sizes: ParallelSizes
    state_bytes: float  # weights + grads + optimizer state on the busiest stage
    activation_bytes: float  # dry_run.activation_bytes
    problem: str = ""  # the config rule this CP breaks at this seq_len; "" when it can run

    @property
    def context_parallel(self) -> int:
        return self.sizes.context_parallel

    @property
    def tokens_per_rank(self) -> int:
        return self.cfg.data.seq_len // self.context_parallel

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    def fits(self, budget_bytes: float) -> bool:
        return not self.problem and self.total_bytes <= budget_bytes


def at_context_parallel(cfg: RunConfig, context_parallel: int, seq_len: int) -> RunConfig:
    """``cfg`` at CP ``context_parallel`` and ``data.seq_len=seq_len``, its world the run's, or the
    smallest multiple of TP x PP x CP above it."""
    parallel = cfg.parallel
    group = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size * context_parallel
    world = -(-parallel.world_size // group) * group
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(parallel, context_parallel_size=context_parallel, world_size=world),
        data=dataclasses.replace(cfg.data, seq_len=seq_len))


def context_option(cfg: RunConfig, context_parallel: int, seq_len: int) -> ContextOption:
    at = at_context_parallel(cfg, context_parallel, seq_len)
    sizes = derive_parallel_sizes(at.parallel)
    problems = check_run_config(at)
    return ContextOption(cfg=at, sizes=sizes, state_bytes=build_parallel_plan(at).memory_per_rank_bytes,
                         activation_bytes=activation_bytes(at, sizes), problem=problems[0] if problems else "")


def context_options(cfg: RunConfig, seq_len: int) -> list[ContextOption]:
    """The run at every size of ``CONTEXT_PARALLEL_SIZES`` and its own, smallest first."""
    sizes = sorted({*CONTEXT_PARALLEL_SIZES, cfg.parallel.context_parallel_size})
    return [context_option(cfg, cp, seq_len) for cp in sizes]


def smallest_fitting(options: list[ContextOption], budget_bytes: float) -> Optional[ContextOption]:
    """The smallest CP that runs and fits: memory falls with CP, communication grows with it."""
    return next((option for option in options if option.fits(budget_bytes)), None)


# ------------------------------------------------------------------------------- encoder_cp's gain


def long_video_row(data: DataConfig, model: ModelConfig) -> list[SampleCost]:
    """The row the encoder_cp line prices, the case CP is for: as many videos of
    ``data.video_max_frames`` frames at ``data.video_max_pixels`` as fit in ``data.seq_len`` tokens,
    one per sample, video tokens only."""
    vision, merge_unit = model.vision, model.projector.spatial_merge_size ** 2
    frame_patches = data.video_max_pixels // vision.patch_size ** 2 // merge_unit * merge_unit
    patches = -(-data.video_max_frames // vision.temporal_patch_size) * frame_patches
    tokens = patches // merge_unit
    frames = patches // frame_patches
    # Only t and h * w of the grid are read (encoder_cp deals frames): h = merge keeps h * w exact.
    grid = (frames, model.projector.spatial_merge_size, frame_patches // model.projector.spatial_merge_size)
    return [SampleCost(tokens, (patches,), grids=(grid,)) for _ in range(data.seq_len // tokens)]


def rank_cost_model(cfg: RunConfig, sizes: ParallelSizes) -> CostModel:
    """The FLOP cost model of the run's shapes (``balance.cost_model.flops_model``) for one rank of a
    TP group: the language terms / TP, the vision terms / the ranks that split the encoder's work
    (the vision TP; the TP group with ``encoder_dp=tp``)."""
    split, vision = split_parameters(cfg.model), cfg.model.vision
    merge_unit = cfg.model.projector.spatial_merge_size ** 2
    full_attention = vision.depth if vision.window is None else vision.window.full_attention_blocks(vision.depth)
    model = flops_model(hidden=cfg.model.language.hidden_size, layers=cfg.model.language.num_layers,
                        params_language=split.active - split.vision_model - split.projector,
                        vision_hidden=vision.hidden_size, vision_full_attention_layers=full_attention,
                        params_vision=split.vision_model + split.projector / merge_unit,
                        achieved_flops_per_s=ACHIEVED_FLOPS_PER_S)
    language = {term: model.coefficients[term] / sizes.tensor_parallel for term in LANGUAGE_TERMS}
    encoder_ranks = sizes.tensor_parallel if cfg.parallel.encoder_dp == "tp" else sizes.vision_tensor_parallel
    return with_vision_spread(dataclasses.replace(model, coefficients={**model.coefficients, **language}),
                              encoder_ranks)


def encoder_cp_text(option: ContextOption) -> str:
    """One line: the predicted step time per rank at ``option``'s CP with encoder_cp on and off; ""
    where it does not apply (CP 1, no online encoder, a video longer than the row)."""
    cfg, sizes = option.cfg, option.sizes
    if option.context_parallel == 1 or cfg.model.vision is None or cfg.data.vision_embeddings is not None:
        return ""
    if cfg.parallel.encoder_dp == "full":
        return (f"CP{option.context_parallel}: parallel.encoder_cp does not apply with parallel.encoder_dp=full "
                f"(whole steps' media are divided over TP x PP)")
    row = long_video_row(cfg.data, cfg.model)
    if not row:
        return ""
    micro_batches = cfg.training.global_batch_size // sizes.data_parallel
    gain = encoder_cp_gain(rank_cost_model(cfg, sizes), row, option.context_parallel)
    return (f"CP{option.context_parallel}: predicted step time per rank {micro_batches * gain.on_s:.1f} s with "
            f"parallel.encoder_cp=true, {micro_batches * gain.off_s:.1f} s with false ({gain.gain:.0%} less): "
            f"{micro_batches} rows of {len(row)} videos x {row[0].patches[0]} patches "
            f"({cfg.data.video_max_frames} frames at data.video_max_pixels), the FLOP cost model at "
            f"{ACHIEVED_FLOPS_PER_S / 1e12:.0f} TFLOP/s achieved")


# ----------------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class ContextPlan:
    seq_len: int
    gpu_memory_gib: float
    options: list[ContextOption]  # smallest CP first
    run_context_parallel: int  # the run's parallel.context_parallel_size
    run_world_size: int
    fit_requested: bool  # --fit-seq-len: choose a CP and print its overrides
    # The smallest CP that fits with training.recompute_activations=true, when the run has it off.
    recompute_fit: Optional[ContextOption] = None

    @property
    def budget_bytes(self) -> float:
        return self.gpu_memory_gib * USABLE_SHARE * GIB

    @property
    def chosen(self) -> Optional[ContextOption]:
        return smallest_fitting(self.options, self.budget_bytes)

    @property
    def run_option(self) -> ContextOption:
        return next(option for option in self.options if option.context_parallel == self.run_context_parallel)

    @property
    def focus(self) -> Optional[ContextOption]:
        """The CP the encoder_cp line is about: the fit's choice, else the run's own."""
        return self.chosen if self.fit_requested else self.run_option


def build_context_plan(cfg: RunConfig, *, fit_seq_len: Optional[int] = None,
                       gpu_memory_gib: float = GPU_MEMORY_GIB) -> ContextPlan:
    """The run at every CP size at ``data.seq_len``, or at ``fit_seq_len`` to choose one."""
    seq_len = fit_seq_len or cfg.data.seq_len
    plan = ContextPlan(seq_len=seq_len, gpu_memory_gib=gpu_memory_gib, options=context_options(cfg, seq_len),
                       run_context_parallel=cfg.parallel.context_parallel_size,
                       run_world_size=cfg.parallel.world_size, fit_requested=fit_seq_len is not None)
    if not plan.fit_requested or cfg.training.recompute_activations:
        return plan
    recomputing = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, recompute_activations=True))
    return dataclasses.replace(plan, recompute_fit=smallest_fitting(context_options(recomputing, seq_len),
                                                                    plan.budget_bytes))


def _world_note(option: ContextOption, run_world_size: int) -> str:
    world = option.sizes.world_size
    return "" if world == run_world_size else f", world {world}"


def _table(plan: ContextPlan) -> list[str]:
    rows = [("CP", "layout", "tokens/rank", "activations GiB", "total GiB", "fits")]
    for option in plan.options:
        fits = "yes" if option.fits(plan.budget_bytes) else f"no: {option.problem}" if option.problem else "no"
        rows.append((str(option.context_parallel), layout_label(option.sizes) + _world_note(option, plan.run_world_size),
                     str(option.tokens_per_rank), f"{option.activation_bytes / GIB:.1f}",
                     f"{option.total_bytes / GIB:.1f}", fits))
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    return ["  " + "  ".join(cell.rjust(width) if column in (0, 2, 3, 4) else cell.ljust(width)
                             for column, (cell, width) in enumerate(zip(row, widths))) + "  " + row[5]
            for row in rows]


def _override_line(option: ContextOption, run_world_size: int) -> str:
    world = option.sizes.world_size
    return (f"parallel.context_parallel_size={option.context_parallel} data.seq_len={option.cfg.data.seq_len}"
            + (f" parallel.world_size={world}" if world != run_world_size else ""))


def _fit_lines(plan: ContextPlan) -> list[str]:
    budget = f"{plan.budget_bytes / GIB:.1f} GiB per rank"
    chosen = plan.chosen
    blocked = next((option for option in plan.options if option.total_bytes <= plan.budget_bytes), None)
    if chosen is None and blocked is not None:  # small enough, but against a config rule at this seq_len
        lines = [f"fit: CP{blocked.context_parallel} would fit seq_len {plan.seq_len} in {budget} "
                 f"(~{blocked.total_bytes / GIB:.1f} GiB), but {blocked.problem.rstrip('.')}"]
    elif chosen is None:
        largest = plan.options[-1]
        recompute = "" if largest.cfg.training.recompute_activations else ", turn on training.recompute_activations"
        lines = [f"fit: no CP size up to {largest.context_parallel} fits seq_len {plan.seq_len} in {budget} "
                 f"(CP{largest.context_parallel}: ~{largest.total_bytes / GIB:.1f} GiB); raise TP or PP{recompute} "
                 f"or lower --fit-seq-len"]
    else:
        world = chosen.sizes.world_size
        needs = (f"; it needs {world} processes, the run has {plan.run_world_size}"
                 if world != plan.run_world_size else "")
        lines = [f"fit: CP{chosen.context_parallel} is the smallest context-parallel size that fits seq_len "
                 f"{plan.seq_len} in {budget} (~{chosen.total_bytes / GIB:.1f} GiB){needs}; run with",
                 f"  {_override_line(chosen, plan.run_world_size)}"]
    recompute = plan.recompute_fit
    if recompute is not None and (chosen is None or recompute.context_parallel < chosen.context_parallel):
        lines.append(f"  or, with training.recompute_activations=true (every layer's forward twice): CP"
                     f"{recompute.context_parallel} fits (~{recompute.total_bytes / GIB:.1f} GiB): "
                     f"{_override_line(recompute, plan.run_world_size)} training.recompute_activations=true")
    return lines


def _chunked_head_text(option: ContextOption) -> str:
    """What ``training.loss_chunk_tokens`` saves at the run's CP: the chunk's logits against the row's."""
    whole = lm_head_activation_bytes(option.cfg, option.sizes, whole=True)
    chunk_tokens = option.cfg.training.loss_chunk_tokens
    if not chunk_tokens:
        chunked_cfg = dataclasses.replace(option.cfg, training=dataclasses.replace(
            option.cfg.training, loss_chunk_tokens=SUGGESTED_LOSS_CHUNK_TOKENS))
        chunked = lm_head_activation_bytes(chunked_cfg, option.sizes)
        return (f": the whole row's logits, {whole / GIB:.2f} GiB; training.loss_chunk_tokens="
                f"{SUGGESTED_LOSS_CHUNK_TOKENS} would hold {chunked / GIB:.2f} GiB")
    chunked = lm_head_activation_bytes(option.cfg, option.sizes)
    return (f"; {chunk_tokens} tokens' logits at a time, training.loss_chunk_tokens: {chunked / GIB:.2f} GiB "
            f"where the whole row's are {whole / GIB:.2f} GiB")


def format_context_plan(plan: ContextPlan) -> str:
    """The CP table, the encoder_cp line and (``--fit-seq-len``) the choice with its overrides."""
    run = plan.run_option
    recompute = "with" if run.cfg.training.recompute_activations else "without"
    head = f"the LM head's (every token a loss token{_chunked_head_text(run)})"
    extra = (head if run.cfg.model.vision is None or run.cfg.data.vision_embeddings is not None else
             f"the larger of the vision encoder's (every token an image token, parallel.encoder_dp="
             f"{run.cfg.parallel.encoder_dp}) and {head}")
    lines = [f"context parallel at seq_len {plan.seq_len}, memory per rank (fits: total <= "
             f"{plan.budget_bytes / GIB:.1f} GiB, {USABLE_SHARE:.0%} of {plan.gpu_memory_gib:g} GiB per GPU; "
             f"--gpu-memory-gib to change)",
             *_table(plan),
             f"  activations, an estimate: the decoder's ({recompute} training.recompute_activations) and "
             f"{extra}; total adds weights, grads and optimizer state (sharded over DP x CP)"]
    focus = plan.focus
    gain = encoder_cp_text(focus) if focus is not None else ""
    if gain:
        lines.append(f"  encoder_cp  {gain}")
    if plan.fit_requested:
        lines += _fit_lines(plan)
    return "\n".join(lines)
