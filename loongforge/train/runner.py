"""``loongforge train``: build everything from a resolved RunConfig and run the training loop.

Order of operations (each step needs the previous one):
  process groups -> CPU patches (a CPU run only) -> model -> DDP -> optimizer and schedule -> data
  pipeline -> optional checkpoint restore -> run folder files -> steps -> final checkpoint and
  summary. The run folder is written only after the restore, so a failed --resume changes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from loongforge import __version__
from loongforge.config.data_sets import HELD_OUT_SET, named_sets
from loongforge.config.errors import InputError
from loongforge.config.layout import (
    DataParallelSettings,
    data_parallel_settings,
    resolve_read,
    row_multiple,
    sample_multiple,
    vision_tensor_parallel_size,
)
from loongforge.config.pipeline_layout import virtual_stages
from loongforge.config.loader import dump_yaml
from loongforge.config.schema import ParallelConfig, RunConfig
from loongforge.config.validate import LORA_TE_REFUSAL, validate
from loongforge.convert.checkpoint_folders import (
    LORA_BASE_KEY,
    META_FILE,
    latest_checkpoint,
    step_dir_name,
    weights_digest,
)
from loongforge.convert.model_io import export_hf, load_hf_weights
from loongforge.data.arrow_samples import cache_summary
from loongforge.data.mixture import entry_path
from loongforge.data.pipeline import DataPipeline
from loongforge.models.flops import StepFlops
from loongforge.models.layers.fp8 import (
    Fp8WeightCache,
    apply_fp8,
    check_fp8_backend,
    describe_fp8_layers,
    fp8_choice,
)
from loongforge.models.layers import compiled
from loongforge.models.layers.compiled import compile_note, compile_parts
from loongforge.models.layers.layer_backend import passed_over_backends, resolve_layer_backend
from loongforge.models.layers.lora import apply_lora, describe_lora
from loongforge.models.decoder.moe_balance import ExpertLoadCounter, unscaled_balance_losses
from loongforge.models.decoder.sparse_attention import freeze_for_stage
from loongforge.models.registry import get_family
from loongforge.parallel import mcore_patches
from loongforge.parallel.data_groups import build_data_groups
from loongforge.parallel.distributed import (
    DistributedEnv,
    ParallelLayout,
    all_gather_tensor,
    init_distributed,
    init_model_parallel,
    shutdown,
)
from loongforge.parallel.encoder_dp import add_encoder_grads, sum_encoder_grads
from loongforge.parallel.launch_env import order_tensor_parallel_kernels
from loongforge.parallel.progress import RankProgress
from loongforge.profile.encoder_clock import EncoderClock, EncoderTime
from loongforge.profile.memory import peak_memory_mib
from loongforge.profile.throughput import (
    Throughput,
    device_peak_tflops,
    run_dtype,
    steps_flops,
)
from loongforge.profile.timers import GradSyncClock, cpu_clock
from loongforge.train.balancing import RunBalancing
from loongforge.train.checkpoint import (
    DISTRIBUTED_OPTIMIZER_KEY,
    TrainState,
    check_optimizer_kind,
    load_checkpoint,
    load_newest_checkpoint,
    load_weights_only,
    save_checkpoint,
    saved_data_states,
    saved_dp_size,
)
from loongforge.train.metrics import (
    METRICS_FILE,
    RunLogger,
    StepMetrics,
    drop_metrics_after,
)
from loongforge.train.observer import TrainingObserver
from loongforge.train.optim import build_optimizer, build_scheduler
from loongforge.train.preference_step import preference_train_step
from loongforge.train.preflight import check_data, checkpoint_root
from loongforge.train.reference import build_reference
from loongforge.train.step import ManualGC, StepResult, clear_moe_loss_tracker, forward_only, train_step
from loongforge.train.stop import StopRequest, catch_stop_signals, signal_name
from loongforge.train.validation import ValidationSets, rejects_file
from loongforge.train.vision_embeddings import DIGEST_KEY, frozen_encoder_note, open_vision_embeddings

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TrainingSummary:
    start_step: int
    end_step: int
    losses: list = field(default_factory=list)  # (step, loss) for the steps run in this call
    rejects: dict = field(default_factory=dict)
    output_dir: Optional[str] = None
    checkpoint: Optional[str] = None
    wall_s: float = 0.0
    balance: Optional[dict] = None  # balance.enabled: applied/skipped steps, mean max/LB before/after
    sync_waits: list = field(default_factory=list)  # measured imbalance per step (multi-rank runs)
    throughput: list = field(default_factory=list)  # profile.throughput.Throughput per step
    stop_signal: int = 0  # SIGTERM/SIGINT that stopped the run early (0: it ran to its last step)
    # (step, {set name: ValidationLoss.as_dict()}) per evaluation in this call (training.eval_interval)
    validation: list = field(default_factory=list)
    validation_rejects: dict = field(default_factory=dict)  # {set name: {reason: count}}
    sources: Optional[dict] = None  # weighted data.paths: per source, samples/tokens trained, epochs

    @property
    def mean_sync_wait_s(self) -> Optional[float]:
        return sum(self.sync_waits) / len(self.sync_waits) if self.sync_waits else None

    def throughput_means(self) -> dict:
        """Model and hardware TFLOP/s per GPU, MFU and HFU over the steps after the first (which
        pays for warm-up), and the encoder's share of the model FLOPs; {} before any step."""
        steps = self.throughput
        if not steps:
            return {}
        steady = steps[1:] if len(steps) > 1 else steps
        flops, seconds = sum(t.model_flops for t in steady), sum(t.step_s for t in steady)
        hardware = sum(t.model_flops if t.hardware_flops is None else t.hardware_flops for t in steady)
        total = Throughput(model_flops=flops, encoder_flops=sum(t.encoder_flops for t in steady), step_s=seconds,
                           world_size=steady[0].world_size, peak_tflops=steady[0].peak_tflops,
                           hardware_flops=hardware)
        return {"model_tflops_per_gpu": total.tflops_per_gpu, "mfu": total.mfu,
                "hardware_tflops_per_gpu": total.hardware_tflops_per_gpu, "hfu": total.hfu,
                "encoder_flops_share": total.encoder_share}


def library_versions() -> dict:
    versions = {"loongforge": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("megatron.core", "transformers", "transformer_engine", "flash_attn"):
        try:
            module = __import__(name, fromlist=["__version__"])
            versions[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            continue
    return versions


def _write_run_files(out_dir: Path, cfg: RunConfig, command_line: list[str], env: DistributedEnv,
                     layout: ParallelLayout, model: list, optimizer) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(dump_yaml(cfg))
    (out_dir / "command.txt").write_text(" ".join(command_line) + "\n")
    environment = {"versions": library_versions(), "world_size": env.world_size,
                   "backend": env.backend, "device": str(env.device),
                   "layout": {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size},
                   "layer_backends": _unwrap_model(model[0]).layer_backends,
                   "fp8_layers": {kind: list(counts) for kind, counts in _unwrap_model(model[0]).fp8_layers.items()},
                   "precision": precision_record(model, optimizer)}
    (out_dir / "environment.json").write_text(json.dumps(environment, indent=2))


def _build_ddp_model(cfg: RunConfig, layout: ParallelLayout, device: torch.device,
                     balancing: RunBalancing, layer_backend: str, *, resume: bool):
    """This rank's model chunks (one per virtual pipeline stage), wrapped for training."""
    virtual = virtual_stages(cfg.parallel)
    chunks = [_build_chunk(cfg, layout, device, balancing, layer_backend, stage, virtual) for stage in range(virtual)]
    return wrap_for_training(chunks, cfg.parallel, saved_distributed_optimizer=_loaded_optimizer_kind(cfg, resume))


def _loaded_optimizer_kind(cfg: RunConfig, resume: bool) -> Optional[bool]:
    """Whether the checkpoint this run will load holds the distributed optimizer's state (None: none
    to load): ``--resume``'s newest, or ``checkpoint.load`` unless only its weights are taken."""
    if resume:
        path = latest_checkpoint(checkpoint_root(cfg))
    else:
        path = None if cfg.checkpoint.weights_only else cfg.checkpoint.load
    if path is None:
        return None
    return check_optimizer_kind(Path(path), cfg.parallel.use_distributed_optimizer)


def _build_chunk(cfg: RunConfig, layout: ParallelLayout, device: torch.device, balancing: RunBalancing,
                 layer_backend: str, stage: int, virtual: int):
    """Virtual stage ``stage`` of this pipeline rank: the embedding (and encoder) on the first stage
    of rank 0, the head on the last stage of the last rank."""
    model = get_family(cfg.model.family).build(
        cfg.model, cfg.parallel, params_dtype=_DTYPES[cfg.training.precision],
        pre_process=layout.is_first_stage and stage == 0, post_process=layout.is_last_stage and stage == virtual - 1,
        vp_stage=stage if virtual > 1 else None, device=device,
        recompute_activations=cfg.training.recompute_activations, init_seed=cfg.training.seed,
        loss_chunk_tokens=cfg.training.loss_chunk_tokens, vision_cost=balancing.vision_cost, with_encoder=cfg.data.vision_embeddings is None)
    _freeze(model, cfg)
    # Adapters before DDP: its gradient buffers and the optimizer then hold the adapters alone.
    model.lora_note = _apply_lora(model, cfg)
    decide, note = fp8_choice(cfg, device, layer_backend)
    if decide is not None and cfg.lora.rank:  # models.layers.fp8 runs a frozen weight's GEMMs in bf16 anyway
        decide, note = None, f"fp8: {cfg.training.fp8}, but LoRA freezes every base weight: bf16 everywhere"
    # One E4M3 copy of each FP8 weight per optimizer step (train.step drops them after the update).
    model.fp8_weights = Fp8WeightCache() if decide is not None else None
    model.fp8_layers = apply_fp8(model, decide, model.fp8_weights) if decide is not None else {}
    model.fp8_note = note + (f": {describe_fp8_layers(model.fp8_layers)}" if model.fp8_layers else "")
    return model


def wrap_for_training(model, parallel_cfg: ParallelConfig, *,
                      saved_distributed_optimizer: Optional[bool] = None) -> tuple[list, object]:
    """Built model chunks (or one model) as the step trains them: megatron's DDP wrapper (fp32
    gradient buffers) around each, and the per-token loss normalisation; (wrapped chunks, the first
    chunk's TransformerConfig, which the pipeline schedule reads). ``saved_distributed_optimizer``:
    the kind of optimizer state of the checkpoint the run will load (``data_parallel_settings``)."""
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        # Per-token loss: gradients are divided by the global loss-token count in finalize_model_grads.
        chunk.config.calculate_per_token_loss = True
        unscaled_balance_losses(chunk)
    config = chunks[0].config
    config.finalize_model_grads_func = functools.partial(_finalize_grads, finalize_model_grads)
    settings = data_parallel_settings(
        parallel_cfg, parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        saved_distributed_optimizer)
    # train.optim builds the optimizer from this config (megatron's optimizer must match its DDP's).
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.distributed_optimizer,
        overlap_param_gather=settings.overlap_param_gather,
    )
    # One bucket for each chunk after the first (as Megatron-LM sets it): the interleaved schedule
    # already overlaps their reduction with the other chunks' compute.
    wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(wrapped) == 1 else no_sync
    if settings.overlap_grad_reduce and len(wrapped) > 1:
        # The interleaved schedule starts each chunk's reduction when its last backward is done.
        config.grad_sync_func = [chunk.start_grad_sync for chunk in wrapped]
    return wrapped, config


def _apply_lora(model, cfg: RunConfig) -> Optional[str]:
    """``lora.rank > 0``: adapters on the chosen linears, every base weight frozen; the line saying
    what trains (None without LoRA)."""
    if not cfg.lora.rank:
        return None
    return describe_lora(apply_lora(model, cfg.model, cfg.lora, seed=cfg.training.seed), model)


def _freeze(model, cfg: RunConfig) -> None:
    """training.freeze_vision / freeze_projector / freeze_language: those parts take no gradient
    (where this rank holds them); model.language.sparse_attention.stage=dense_warmup: nothing but the indexers
    takes one."""
    towers, training = model.towers(), cfg.training
    flags = ((training.freeze_vision, "vision"), (training.freeze_projector, "projector"),
             (training.freeze_language, "language"))
    frozen = [tower for flag, name in flags if flag for tower in towers[name]]
    for tower in frozen:
        for param in tower.parameters():
            param.requires_grad_(False)
    freeze_for_stage(model)  # sparse attention's dense_warmup: the indexers alone train


def _finalize_grads(finalize_model_grads, model: list, *args, **kwargs) -> None:
    """After the pipeline flush: the encoder gradients of a step encoded up front
    (``parallel.encoder_dp=full``: the model's ``finish_step``, already summed over the
    model-parallel group) handed to megatron's DDP before it reduces; megatron's gradient reduction;
    then the sum of a shared encoder's gradients over the ranks that divided its media
    (``parallel.encoder_dp=tp``; nothing is marked otherwise)."""
    for chunk in model:
        finish = getattr(_unwrap_model(chunk), "finish_step", None)
        if finish is not None:
            add_encoder_grads(chunk, finish())
    finalize_model_grads(model, *args, **kwargs)
    sum_encoder_grads(model)


def precision_record(model: list, optimizer) -> dict:
    """The dtypes this run really trains with: model parameters, the gradients megatron's DDP
    reduces into (``main_grad``), and the parameters the optimizer updates."""
    param = next(p for p in _unwrap_model(model[0]).parameters() if p.requires_grad)
    inner = next(iter(getattr(optimizer, "chained_optimizers", [optimizer]))).optimizer
    main_param = inner.param_groups[0]["params"][0]
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    return {"params": name(param.dtype), "main_grads": name(param.main_grad.dtype),
            "main_params": name(main_param.dtype)}


def _unwrap_model(chunk):
    """The family's model inside megatron's DDP wrapper."""
    return getattr(chunk, "module", chunk)


def _pad_multiple(cfg: RunConfig, layout: ParallelLayout) -> int:
    # Pipeline stages exchange fixed-shape activations, so rows are padded to seq_len there;
    # otherwise a small multiple keeps TP/sequence-parallel splits even without wasting compute,
    # and under context parallelism every CP rank's share of the row even (``row_multiple``).
    if layout.pp_size > 1:
        return cfg.data.seq_len
    return math.lcm(8 * layout.tp_size, row_multiple(cfg.data, cfg.parallel))


# What every rank measures each step, logged per rank (``<name>_by_rank`` in metrics.jsonl): its
# vision encoder's forward+backward seconds, wall (device time on CUDA) and CPU (None on a rank
# without the encoder: a later pipeline stage), its train_step's CPU seconds (its own work, free of
# waits and of other processes on the cores) and its peak memory so far (``profile.memory``).
RANK_MEASURES = ("encoder_s", "encoder_cpu_s", "step_cpu_s", "peak_memory_mib", "pipeline_s", "pipeline_cpu_s")


@dataclass
class _StepTotals:
    tokens: int  # real tokens over all ranks
    sync_wait_s: Optional[float]  # spread of the gradient-sync time over ranks (None at one rank)
    vision_features_bytes: int  # the most bytes a rank held for the step's features (encoder_dp=full)
    by_rank: dict  # RANK_MEASURES name -> [value of rank 0, rank 1, ...], and "model_tflop"
    model_flops: float  # the step's model FLOPs, over all replicas
    encoder_flops: float  # of which the vision encoder's and projector's
    hardware_flops: float  # the model FLOPs and the recomputed forwards, over all replicas


def _rank_measures(encoder: Optional[EncoderTime], step_cpu_s: float, device: torch.device,
                   result: StepResult) -> list[float]:
    """This rank's RANK_MEASURES, NaN for an encoder it does not hold."""
    encoder_s = (encoder.total_s, encoder.total_cpu_s) if encoder else (math.nan, math.nan)
    return [*encoder_s, step_cpu_s, peak_memory_mib(device), result.pipeline_s, result.pipeline_cpu_s]


def _step_totals(micro_batches: list[dict], count_here: bool, sync_s: float, vision_bytes: int,
                 measures: list[float], flops: Optional[tuple[StepFlops, StepFlops]]) -> _StepTotals:
    """Tokens, sync-time spread, the most vision-feature bytes a rank held, every rank's
    ``measures`` (RANK_MEASURES) and the (model, hardware) FLOPs of its micro-batches, one
    collective. Tokens and FLOPs are counted by one rank per model replica (``count_here``:
    ``flops`` given)."""
    local = sum(sum(mb["sample_lengths"]) for mb in micro_batches) if count_here else 0
    model, hardware = flops if flops else (None, None)
    model_flops, encoder_flops = (model.total, model.vision + model.projector) if model else (math.nan, 0.0)
    row = torch.tensor([float(local), sync_s, float(vision_bytes), model_flops, encoder_flops,
                        hardware.total if hardware else 0.0, *measures], dtype=torch.float64)
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = row.view(1, -1)  # [rank, 6 + measures]
    if world > 1:
        gathered = torch.zeros(world * row.numel(), dtype=torch.float64)
        all_gather_tensor()(gathered, row)
        per_rank = gathered.view(world, -1)
    by_rank = {name: [None if math.isnan(value) else value for value in per_rank[:, 6 + i].tolist()]
               for i, name in enumerate(RANK_MEASURES)}
    by_rank["model_tflop"] = [None if math.isnan(value) else value / 1e12 for value in per_rank[:, 3].tolist()]
    sync_wait = float(per_rank[:, 1].max() - per_rank[:, 1].min()) if world > 1 else None
    return _StepTotals(tokens=int(per_rank[:, 0].sum()), sync_wait_s=sync_wait,
                       vision_features_bytes=int(per_rank[:, 2].max()), by_rank=by_rank,
                       model_flops=float(per_rank[:, 3].nansum()), encoder_flops=float(per_rank[:, 4].sum()),
                       hardware_flops=float(per_rank[:, 5].sum()))


def _encoder_clock(model: list, device: torch.device) -> Optional[EncoderClock]:
    """A clock on this rank's vision tower and projector; None where the stage has none."""
    inner = _unwrap_model(model[0])
    towers = [getattr(inner, name, None) for name in ("vision_model", "projector")]
    return EncoderClock(towers, device) if all(tower is not None for tower in towers) else None


def run_training(cfg: RunConfig, *, resume: bool = False,
                 command_line: Optional[list[str]] = None,
                 observer: Optional[TrainingObserver] = None) -> TrainingSummary:
    """Train according to ``cfg``; the process group is created here unless a caller already did.

    ``observer`` (``loongforge profile``) sees every step. The run's cost model (``balance.*``:
    load, fit online, checkpoint) is ``train.balancing.RunBalancing``'s.
    """
    wall_start = time.perf_counter()
    owns_process_group = not dist.is_initialized()
    # Before the process group: a preemption during start-up also waits for the first step end.
    with catch_stop_signals() as stop:
        order_tensor_parallel_kernels(max(cfg.parallel.tensor_model_parallel_size,
                                          vision_tensor_parallel_size(cfg.parallel)) > 1)
        env = init_distributed(cfg.training.device, timeout_s=cfg.parallel.collective_timeout_s)
        progress = RankProgress.of_default_group()
        try:
            return _train(cfg, env, resume=resume, command_line=command_line, wall_start=wall_start,
                          observer=observer, stop=stop, progress=progress)
        except RuntimeError as exc:
            named = _named_timeout(exc, cfg.parallel.collective_timeout_s, progress)
            if named is exc:
                raise
            raise named from exc
        finally:
            if owns_process_group:
                shutdown(env)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than parallel.collective_timeout_s for another rank."""


def _named_timeout(exc: RuntimeError, timeout_s: int, progress: RankProgress) -> RuntimeError:
    """A collective timeout as one line: this rank, its step, the limit, the ranks that did not
    arrive (see ``parallel.progress``) and torch's own text; other errors are returned unchanged."""
    text = str(exc)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return exc
    # The other waiting ranks time out within about a step of this one.
    hung = progress.name_hung_ranks(wait_s=min(60.0, timeout_s / 4))
    first_line = next((line for line in text.splitlines() if line.strip()), text).strip()
    return CollectiveTimeout(
        f"rank {progress.rank}, step {progress.step}: a collective waited more than "
        f"parallel.collective_timeout_s={timeout_s} s" + (f"; {hung}" if hung else "")
        + f" (torch: {first_line})")


@dataclass
class _Run:
    """What one training run is built from, in the module docstring's order."""

    cfg: RunConfig
    env: DistributedEnv
    layout: ParallelLayout
    model: list
    model_config: object
    optimizer: object
    scheduler: object
    pipeline: object  # DataPipeline, or what the observer put in its place (profile --sweep)
    balanced: Optional[DataPipeline]  # the pipeline, when balance.enabled
    balancing: RunBalancing
    observer: TrainingObserver
    sync_clock: GradSyncClock
    encoder_clock: Optional[EncoderClock]  # this rank's vision encoder time, None without one
    out_dir: Path
    ckpt_root: Path
    encoder_digest: Optional[str] = None  # data.vision_embeddings: the encoder the store matched
    expert_load: Optional[ExpertLoadCounter] = None  # mixture-of-experts models: tokens per expert
    peak_tflops: Optional[float] = None  # per GPU, the MFU denominator (None: unknown device)
    backend_notes: tuple = ()  # layer backends auto passed over although installed (layer_backend)
    lora_base: Optional[dict] = None  # LoRA: the frozen base and the settings, recorded in checkpoints
    validation: ValidationSets = field(default_factory=lambda: ValidationSets({}, eval_iters=0))
    context_group: Optional[dist.ProcessGroup] = None  # the CP group, None at CP 1
    # Preference training's frozen reference model (train.reference); None for SFT and reference-free losses.
    reference: Optional[list] = None


def _build_run(cfg: RunConfig, env: DistributedEnv, observer: Optional[TrainingObserver], *, resume: bool) -> _Run:
    validate(cfg, world_size=env.world_size, layout=get_family(cfg.model.family).layout)
    check_data(cfg)  # library callers (profile) too: unreadable data.paths before the model
    # An impossible model.layer_backend is a config error before anything is written or built.
    backend = resolve_layer_backend(cfg.model.layer_backend, env.device, _DTYPES[cfg.training.precision])
    check_fp8_backend(cfg.training.fp8, backend)
    if cfg.lora.rank and backend == "te":  # auto chose Transformer Engine, whose linears LoRA does not wrap
        raise InputError(LORA_TE_REFUSAL)
    if env.device.type == "cpu":
        mcore_patches.apply_cpu()
    compiled.apply(compile_parts(cfg.training.compile, env.device))  # before the build: the SwiGLU part acts there
    layout = init_model_parallel(cfg.parallel, seed=cfg.training.seed, device=env.device)
    embeddings, encoder_digest = _open_embeddings(cfg, env, resume=resume)
    torch.manual_seed(cfg.training.seed)
    # A profile run measures with its own timers, so the online fit does not record there.
    balancing = RunBalancing(cfg.balance, fit_online=observer is None, prices_vision=embeddings is None,
                             model_in_use=cfg.balance.enabled or cfg.parallel.encoder_dp != "none")
    model, model_config = _build_ddp_model(cfg, layout, env.device, balancing, backend, resume=resume)
    # Before the optimizer copies the params. A LoRA checkpoint holds no base: it is read again here.
    if cfg.checkpoint.load_hf and (cfg.lora.rank or (not resume and cfg.checkpoint.load is None)):
        for chunk in model:
            load_hf_weights(chunk, cfg.checkpoint.load_hf)
    sync_clock = GradSyncClock(model_config, env.device)  # measured imbalance, every step
    balancing.attach(model_config, cfg=cfg, env=env, layout=layout, grad_sync=sync_clock)
    observer = observer or TrainingObserver()
    observer.attach(model_config, cfg=cfg, env=env, layout=layout, grad_sync=sync_clock)
    optimizer = build_optimizer(model, cfg.optimizer, params_dtype=_DTYPES[cfg.training.precision])
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.schedule, train_steps=cfg.training.train_steps)
    pipeline = _build_pipeline(cfg, env, layout, balancing, embeddings)
    validation = ValidationSets(_validation_pipelines(cfg, env, layout, balancing, embeddings),
                                eval_iters=cfg.training.eval_iters)
    return _Run(cfg=cfg, env=env, layout=layout, model=model, model_config=model_config, optimizer=optimizer,
                scheduler=scheduler, pipeline=observer.data_source(pipeline),
                balanced=pipeline if cfg.balance.enabled else None, balancing=balancing, observer=observer,
                sync_clock=sync_clock, encoder_clock=_encoder_clock(model, env.device),
                out_dir=Path(cfg.logging.output_dir), ckpt_root=checkpoint_root(cfg),
                encoder_digest=encoder_digest, lora_base=lora_base(cfg), expert_load=_expert_load_counter(cfg, model, env.device),
                peak_tflops=_peak_tflops(cfg, env.device), validation=validation,
                context_group=parallel_state.get_context_parallel_group() if layout.cp_size > 1 else None,
                backend_notes=tuple(passed_over_backends(cfg.model.layer_backend, env.device,
                                                         _DTYPES[cfg.training.precision])))


def _peak_tflops(cfg: RunConfig, device: torch.device) -> Optional[float]:
    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops
    if device.type != "cuda":
        return None
    return device_peak_tflops(torch.cuda.get_device_name(device), run_dtype(cfg))


def _expert_load_counter(cfg: RunConfig, model: list, device: torch.device) -> Optional[ExpertLoadCounter]:
    language = cfg.model.language
    if not language.moe:
        return None
    return ExpertLoadCounter(model, num_layers=language.num_layers + language.mtp_num_layers,
                             num_experts=language.moe.num_experts, device=device)


def _open_embeddings(cfg: RunConfig, env: DistributedEnv, *, resume: bool):
    """data.vision_embeddings: the store, checked against this run's encoder (see
    ``train.vision_embeddings``), and that encoder's digest; (None, None) without it."""
    if cfg.data.vision_embeddings is None:
        return None, None
    load_path = latest_checkpoint(checkpoint_root(cfg)) if resume else cfg.checkpoint.load
    return open_vision_embeddings(cfg, load_path=Path(load_path) if load_path else None, device=env.device)


def _build_pipeline(cfg: RunConfig, env: DistributedEnv, layout: ParallelLayout,
                    balancing: RunBalancing, embeddings=None) -> DataPipeline:
    # Sharded reading moves data in the loader thread: it gets gloo groups of its own.
    data_groups = None
    if resolve_read(cfg.data, layout.dp_size) == "sharded" and env.world_size > 1:
        data_groups = build_data_groups(
            layout.tp_rank, layout.pp_rank, layout.dp_rank, cp_rank=layout.cp_rank,
            timeout=datetime.timedelta(seconds=cfg.parallel.collective_timeout_s))
    out_dir = Path(cfg.logging.output_dir)
    return DataPipeline(cfg.data, cfg.model, global_batch_size=cfg.training.global_batch_size,
                        dp_rank=layout.dp_rank, dp_size=layout.dp_size, pad_to_multiple=_pad_multiple(cfg, layout),
                        rejects_path=out_dir / "rejects.jsonl" if env.rank == 0 else None,
                        balance_cfg=cfg.balance, pipeline_parallel=layout.pp_size,
                        cost_models=balancing, groups=data_groups,
                        encoder_ranks=_encoder_ranks(cfg, layout), embeddings=embeddings,
                        sample_multiple=sample_multiple(cfg.data, cfg.parallel), dp_group=_data_parallel_gloo(layout),
                        pairs=cfg.preference is not None)


def _validation_pipelines(cfg: RunConfig, env: DistributedEnv, layout: ParallelLayout,
                          balancing: RunBalancing, embeddings=None) -> dict[str, DataPipeline]:
    """One pipeline per validation set (``train.validation``): read whole by every rank, in the
    order of data.valid_paths, the held-out share (data.valid_fraction) last."""
    sets = {name: (dataclasses.replace(cfg.data, source="files", paths=paths, valid_fraction=0.0), False)
            for name, paths in named_sets(list(cfg.data.valid_paths)).items()}
    if cfg.data.valid_fraction:  # every held-out sample once per pass: read without mixture weights
        sets[HELD_OUT_SET] = (dataclasses.replace(cfg.data, paths=[entry_path(p) for p in cfg.data.paths]), True)
    out_dir = Path(cfg.logging.output_dir)
    return {name: DataPipeline(dataclasses.replace(data_cfg, read="global", streaming=False, num_workers=0),
                               cfg.model, global_batch_size=cfg.training.global_batch_size,
                               dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                               pad_to_multiple=_pad_multiple(cfg, layout),
                               rejects_path=rejects_file(out_dir, name) if env.rank == 0 else None,
                               balance_cfg=cfg.balance, pipeline_parallel=layout.pp_size, cost_models=balancing,
                               encoder_ranks=_encoder_ranks(cfg, layout), embeddings=embeddings, held_out=held_out,
                               sample_multiple=sample_multiple(cfg.data, cfg.parallel),
                               dp_group=_data_parallel_gloo(layout))
            for name, (data_cfg, held_out) in sets.items()}


def _data_parallel_gloo(layout: ParallelLayout):
    """megatron-core's gloo data-parallel group (None at DP 1): a pipeline reading global gathers the
    rejects its ranks found decoding over it, on the main thread, in step with the other ranks."""
    return parallel_state.get_data_parallel_group_gloo() if layout.dp_size > 1 else None


def _encoder_ranks(cfg: RunConfig, layout: ParallelLayout) -> int:
    """How many ranks share one data-parallel replica's encoder work (``parallel.encoder_dp``)."""
    if cfg.parallel.encoder_dp == "full":
        return layout.tp_size * layout.pp_size
    if cfg.parallel.encoder_dp == "tp":
        return layout.tp_size
    return 1


@dataclass
class _Restored:
    path: Optional[Path] = None
    step: int = 0
    consumed_rows: int = 0
    skipped: list = field(default_factory=list)  # damaged newer checkpoints (--resume)
    stage_from_step: Optional[int] = None  # checkpoint.weights_only: the step of the weights started from
    schedule_changes: list = field(default_factory=list)  # LR-schedule settings changed since the checkpoint


def _restore(run: _Run, resume: bool) -> _Restored:
    """Load ``--resume``'s newest loadable checkpoint or ``checkpoint.load``; nothing otherwise."""
    load_path = latest_checkpoint(run.ckpt_root) if resume else run.cfg.checkpoint.load
    if resume and load_path is None:
        raise InputError(f"--resume: no complete checkpoint under {run.ckpt_root}; "
                         "run without --resume to start fresh")
    if load_path is None:
        return _Restored()
    skipped: list[str] = []
    if not resume and run.cfg.checkpoint.weights_only:
        return _start_stage(run, Path(load_path))
    if resume:  # the newest that loads: damaged newer ones are skipped, and said so in the log
        load_path, state, skipped = load_newest_checkpoint(run.ckpt_root, run.model, run.optimizer, run.scheduler)
        check_lora_base(Path(load_path), run.lora_base)
    else:  # checked first: adapters loaded onto another base would load without complaint
        if (Path(load_path) / META_FILE).is_file():  # else load_checkpoint says what is missing
            check_lora_base(Path(load_path), run.lora_base)
        state = load_checkpoint(load_path, run.model, run.optimizer, run.scheduler)
    if state.data_state is not None:  # None: a model-only checkpoint (loongforge convert)
        _load_data_state(run, Path(load_path), state.data_state)
    run.balancing.load_state_dict(state.extra)
    return _Restored(path=load_path, step=state.step, consumed_rows=state.consumed_rows, skipped=skipped,
                     schedule_changes=state.schedule_changes)


def _start_stage(run: _Run, path: Path) -> _Restored:
    """checkpoint.weights_only: the weights of ``path`` and nothing else (no optimizer, schedule,
    data position, cost model or RNG state): a new training stage from step 0."""
    step = load_weights_only(path, run.model, run.optimizer)
    return _Restored(path=path, stage_from_step=step)


def lora_base(cfg: RunConfig) -> Optional[dict]:
    """A LoRA run's base (an HF folder and its content digest, or the seed of a random base) and
    adapter settings, as its checkpoints record them; None without LoRA."""
    if not cfg.lora.rank:
        return None
    lora = cfg.lora
    settings = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.targets),
                "modules": list(lora.modules), "experts": lora.experts}
    if cfg.checkpoint.load_hf:
        path = str(Path(cfg.checkpoint.load_hf).resolve())
        return {"kind": "hf", "path": path, "digest": weights_digest(path), **settings}
    return {"kind": "seed", "seed": cfg.training.seed, **settings}


def check_lora_base(path: Path, base: Optional[dict]) -> None:
    """A checkpoint's base and this run's must be the same weights (one line otherwise, exit 2)."""
    recorded = json.loads((path / META_FILE).read_text()).get(LORA_BASE_KEY)
    if base is None and recorded is not None:
        raise InputError(f"{path}: holds LoRA adapters alone (rank {recorded['rank']}); resume it with the run's lora.* "
                         f"settings, or export the merged model with loongforge convert {path} DIR --to hf")
    if base is None:
        return
    if recorded is None:
        raise InputError(f"{path}: holds a whole model, not LoRA adapters; a LoRA run takes its frozen base from "
                         f"checkpoint.load_hf: convert it (loongforge convert {path} DIR --to hf) and set "
                         f"checkpoint.load_hf=DIR")
    same = (recorded["kind"] == base["kind"] and recorded.get("digest") == base.get("digest")
            and recorded.get("seed") == base.get("seed"))
    if not same:
        was = recorded.get("path") or f"the random base of seed {recorded.get('seed')}"
        now = base.get("path") or f"the random base of seed {base.get('seed')}"
        raise InputError(f"{path}: its adapters were trained on {was} and this run's base is {now} (other "
                         f"weights): set checkpoint.load_hf to that base (a copy with the same files will do)")
    changed = [key for key in ("rank", "alpha", "targets", "modules", "experts") if recorded[key] != base[key]]
    if changed:
        raise InputError(f"{path}: was trained with lora.{changed[0]}={recorded[changed[0]]} and this run has "
                         f"lora.{changed[0]}={base[changed[0]]}; set it back to resume these adapters")


def _load_data_state(run: _Run, path: Path, data_state: dict) -> None:
    """The data position; a DataPipeline resumed by a sharded read at another DP size reads every
    rank's (the profile sweep's rows have no position to share)."""
    if not isinstance(run.pipeline, DataPipeline):
        run.pipeline.load_state_dict(data_state)
        return
    run.pipeline.load_state_dict(data_state, saved_states=lambda: saved_data_states(path), checkpoint=str(path),
                                 saved_dp_size=saved_dp_size(path))


def _startup_summary(run: _Run) -> list[str]:
    """Rank 0's opening lines: what runs, on what layout, from which data, balanced how, where."""
    cfg, layout = run.cfg, run.layout
    processes = f"{run.env.world_size} process{'es' if run.env.world_size > 1 else ''}"
    balancing = (f"{run.balanced.balance_mode} mode (data.read={run.balanced.read}), threshold "
                 f"{cfg.balance.threshold}" if run.balanced is not None else "off")
    data = run.pipeline.source_text() if isinstance(run.pipeline, DataPipeline) else "the profile sweep's rows"
    encoder_note = frozen_encoder_note(cfg)
    # The Arrow cache of data files (data.source=files, not streamed): where, how big, room left.
    cache = [cache_summary(cfg.data.cache_dir)] if cfg.data.source == "files" and not cfg.data.streaming else []
    return [f"run: preset {cfg.preset or '(none)'} | {processes}, TP{layout.tp_size} x PP{layout.pp_size} x "
            f"DP{layout.dp_size} on {run.env.device.type} | output {run.out_dir}",
            f"data: {cfg.data.source}, {data}", *cache, *_validation_summary(run),
            f"balance: {balancing}",
            "layers: " + " | ".join(f"{tower} {backend}" for tower, backend in
                                    _unwrap_model(run.model[0]).layer_backends.items()),
            *_data_parallel_lines(run),
            *([encoder_note] if encoder_note else [])]


def _data_parallel_lines(run: _Run) -> list[str]:
    """What megatron's DDP wrapper was built with (``parallel.use_distributed_optimizer`` & co.), where
    gradients have replicas (DP x CP > 1) or a lever is on anyway; nothing at one replica."""
    ddp = run.model[0].ddp_config
    settings = DataParallelSettings(ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather)
    if run.layout.dp_size * run.layout.cp_size == 1 and settings == DataParallelSettings(False, False, False):
        return []
    return [f"data parallel: {settings.describe()}"]


def _validation_summary(run: _Run) -> list[str]:
    """The validation sets and when they are evaluated; nothing without any."""
    if not run.validation:
        return []
    training = run.cfg.training
    when = (f"every {training.eval_interval} steps and after the last" if training.eval_interval
            else "after the last step") + (", and before the first" if training.eval_at_start else "")
    sets = "; ".join(f"{name} ({pipeline.source_text()})" for name, pipeline in run.validation.pipelines.items())
    return [f"validation: {sets} | the first {training.eval_iters} global batches of each, {when}"]


def _open_logger(run: _Run, restored: _Restored) -> RunLogger:
    cfg = run.cfg
    logger = RunLogger(run.out_dir, cfg.training.train_steps, restored.step, cfg.logging.log_interval,
                       enabled=run.env.rank == 0, tensorboard=cfg.logging.tensorboard,
                       progress_bar=cfg.logging.progress_bar)
    for line in (*_startup_summary(run), *run.backend_notes):
        logger.write(line)
    logger.write(compile_note(cfg.training.compile, run.env.device))
    if run.cfg.training.fp8 != "off":
        logger.write(_unwrap_model(run.model[0]).fp8_note)
    if _unwrap_model(run.model[0]).lora_note:
        logger.write(_unwrap_model(run.model[0]).lora_note)
    for reason in restored.skipped:
        logger.write(f"warning: skipped a damaged checkpoint: {reason}")
    if restored.stage_from_step is not None:
        logger.write(f"new stage from the weights of {restored.path} (its step {restored.stage_from_step}); "
                     f"a fresh optimizer, LR schedule and data position")
    elif restored.path is not None:
        logger.write(f"resumed from {restored.path} at step {restored.step}")
    if restored.schedule_changes:  # the config is the truth; the checkpoint's schedule is not kept
        logger.write(f"LR schedule from this run's config, changed since the checkpoint: "
                     f"{', '.join(restored.schedule_changes)}")
    if getattr(run.pipeline, "resume_note", None):  # data.accept_changed_files met a changed file
        logger.write(f"warning: {run.pipeline.resume_note}")
    return logger


def _save(run: _Run, step: int, consumed_rows: int) -> str:
    state = TrainState(step=step, consumed_rows=consumed_rows, data_state=run.pipeline.state_dict(),
                       extra=run.balancing.state_dict())
    layout_info = {"tp": run.layout.tp_size, "pp": run.layout.pp_size, "dp": run.layout.dp_size,
                   "ep": run.cfg.parallel.expert_model_parallel_size,
                   DISTRIBUTED_OPTIMIZER_KEY: run.model[0].ddp_config.use_distributed_optimizer}
    # A run on stored embeddings records the encoder they were checked against: its checkpoints
    # hold no encoder, and a --resume checks the store against this.
    record = {DIGEST_KEY: run.encoder_digest} if run.encoder_digest else {}
    if run.lora_base is not None:
        record[LORA_BASE_KEY] = run.lora_base
    return str(save_checkpoint(run.ckpt_root, state, run.model, run.optimizer, run.scheduler, layout=layout_info,
                               record=record))


def _train(cfg: RunConfig, env: DistributedEnv, *, resume: bool, command_line: Optional[list[str]],
           wall_start: float, observer: Optional[TrainingObserver] = None,
           stop: Optional[StopRequest] = None,
           progress: Optional[RankProgress] = None) -> TrainingSummary:
    run = _build_run(cfg, env, observer, resume=resume)
    restored = _restore(run, resume)
    run.reference = build_reference(cfg, env.device, run.model, fresh_start=restored.step == 0)
    # Only now, with the config valid and the checkpoint loaded, does the run folder change: a
    # failed --resume leaves config.yaml (which `convert` reads) and metrics.jsonl as they were.
    if env.rank == 0:
        _write_run_files(run.out_dir, cfg, command_line or sys.argv, env, run.layout, run.model, run.optimizer)
        if restored.path is not None:
            drop_metrics_after(run.out_dir / METRICS_FILE, restored.step)
    logger = _open_logger(run, restored)
    summary = TrainingSummary(start_step=restored.step, end_step=restored.step, output_dir=str(run.out_dir))
    manual_gc = ManualGC(cfg.training.manual_gc_interval)
    try:
        if cfg.training.eval_at_start and restored.step == 0:
            _evaluate(run, logger, summary, 0)
        consumed_rows = _run_steps(run, logger, summary, restored.consumed_rows, manual_gc, stop,
                                   progress or RankProgress(None, env.rank, env.world_size))
        _finish(run, logger, summary, consumed_rows, wall_start)
    finally:
        manual_gc.close()
        logger.close()
    if env.rank == 0:
        fields = {key: value for key, value in summary.__dict__.items() if key != "throughput"}
        (run.out_dir / "summary.json").write_text(json.dumps(
            {**fields, "mean_sync_wait_s": summary.mean_sync_wait_s, **summary.throughput_means()},
            indent=2, default=str))
    return summary


def _run_steps(run: _Run, logger: RunLogger, summary: TrainingSummary, consumed_rows: int,
               manual_gc: ManualGC, stop: Optional[StopRequest], progress: RankProgress) -> int:
    """The steps from ``summary.start_step + 1``, logged into ``summary``; returns the rows consumed."""
    cfg, layout = run.cfg, run.layout
    is_loss_rank, counts_replica = _is_loss_rank(layout), _counts_replica(layout)
    step_cpu_clock = cpu_clock()
    last_step = min(cfg.training.train_steps, cfg.training.exit_at_step or cfg.training.train_steps)
    for step in range(summary.start_step + 1, last_step + 1):
        progress.begin_step(step)  # named in the error if a collective of this step times out
        fetch_start = time.perf_counter()
        micro_batches = run.pipeline.next_step()
        data_wait = time.perf_counter() - fetch_start
        micro_batches = run.observer.begin_step(step, run.balancing.begin_step(step, micro_batches))
        step_cpu_start = step_cpu_clock()
        preference = None
        if cfg.preference is not None:
            result, preference = preference_train_step(
                run.model, run.reference, run.optimizer, run.scheduler, micro_batches, settings=cfg.preference,
                device=run.env.device, seq_length=cfg.data.seq_len)
        else:
            result = train_step(run.model, run.optimizer, run.scheduler, micro_batches, device=run.env.device,
                                seq_length=cfg.data.seq_len, is_loss_rank=is_loss_rank,
                                context_group=run.context_group)
        step_cpu_s = step_cpu_clock() - step_cpu_start
        expert_load = run.expert_load.take() if run.expert_load is not None else None  # collective
        run.balancing.end_step(step, result)
        run.observer.end_step(step, result, data_wait_s=data_wait)
        consumed_rows += cfg.training.global_batch_size
        encoder = run.encoder_clock.take() if run.encoder_clock is not None else None
        flops = (steps_flops(micro_batches, cfg), steps_flops(micro_batches, cfg, hardware=True)) \
            if counts_replica else None
        totals = _step_totals(micro_batches, counts_replica, run.sync_clock.take(), result.vision_features_bytes,
                              _rank_measures(encoder, step_cpu_s, run.env.device, result), flops)
        step_s = result.compute_s + data_wait
        throughput = Throughput(model_flops=totals.model_flops, encoder_flops=totals.encoder_flops, step_s=step_s,
                                world_size=run.env.world_size, peak_tflops=run.peak_tflops,
                                hardware_flops=totals.hardware_flops)
        decision = run.balanced.last_balance if run.balanced is not None else None
        logger.log_step(StepMetrics(
            step=step, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr, tokens=totals.tokens,
            step_s=step_s, data_wait_s=data_wait, sync_wait_s=totals.sync_wait_s,
            throughput=throughput,
            vision_features_bytes=totals.vision_features_bytes if cfg.parallel.encoder_dp == "full" else None,
            balance=None if decision is None else {"applied": decision.applied, "before": decision.before,
                                                   "after": decision.after},
            by_rank=totals.by_rank, load_balancing_loss=result.load_balancing_loss, expert_load=expert_load,
            mtp_losses=result.mtp_losses, indexer_loss=result.indexer_loss, indexer_topk_mass=result.indexer_topk_mass,
            sources=_sources(run), preference=preference))
        summary.losses.append((step, result.loss))
        summary.throughput.append(throughput)
        if totals.sync_wait_s is not None:
            summary.sync_waits.append(totals.sync_wait_s)
        summary.end_step = step
        if run.validation and (step == cfg.training.train_steps or (
                cfg.training.eval_interval and step % cfg.training.eval_interval == 0)):
            _evaluate(run, logger, summary, step)  # before the save: a resume starts after this step
        # Every rank learns at the same step whether any rank was signalled (see train.stop).
        stop_signal = stop.agree() if stop is not None and step < last_step else 0
        if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
            summary.checkpoint = _save(run, step, consumed_rows)
        elif stop_signal and _saves_on_signal(stop_signal, cfg):
            summary.checkpoint = _save(run, step, consumed_rows)
        manual_gc.after_step(step)
        if stop_signal:
            summary.stop_signal = stop_signal
            break
    return consumed_rows


def _sources(run: _Run) -> Optional[dict]:
    """Weighted data.paths: each source's samples, tokens and epochs so far; None otherwise, and for
    what an observer reads instead of the pipeline (the profile sweep's rows)."""
    return run.pipeline.last_sources if isinstance(run.pipeline, DataPipeline) else None


def _is_loss_rank(layout: ParallelLayout) -> bool:
    """The ranks that report a replica's loss: the last stage's TP rank 0, each CP rank of it (a CP
    rank's loss is that of its share of the row's tokens)."""
    return layout.is_last_stage and layout.tp_rank == 0


def _counts_replica(layout: ParallelLayout) -> bool:
    """One rank per data-parallel replica counts its rows' tokens and FLOPs: the first CP rank of
    the loss ranks (every CP rank of a replica holds the same micro-batches)."""
    return _is_loss_rank(layout) and layout.cp_rank == 0


def _evaluate(run: _Run, logger: RunLogger, summary: TrainingSummary, step: int) -> None:
    """Every validation set's loss after ``step`` (``train.validation``), logged; what the
    evaluation's forwards left in the run's side counters is dropped."""
    layout = run.layout
    if not summary.validation and run.env.rank == 0:
        # Each evaluation meets a set's rejects again; this call lists them once, not once more
        # after each resume (the counts come from the sets' reject logs, not the files).
        for name in run.validation.pipelines:
            rejects_file(run.out_dir, name).unlink(missing_ok=True)
    forward = functools.partial(forward_only, device=run.env.device, seq_length=run.cfg.data.seq_len,
                                is_loss_rank=_is_loss_rank(layout), context_group=run.context_group)
    results = run.validation.evaluate(run.model, forward)
    if run.encoder_clock is not None:
        run.encoder_clock.take()  # the next training step's encoder time starts from here
    clear_moe_loss_tracker(run.model)
    logger.log_validation(step, results)
    summary.validation.append((step, {name: result.as_dict() for name, result in results.items()}))


def _finish(run: _Run, logger: RunLogger, summary: TrainingSummary, consumed_rows: int, wall_start: float) -> None:
    """The final checkpoint and HF export, then the summary line (and the stop line, if stopped)."""
    cfg, checkpoint_cfg = run.cfg, run.cfg.checkpoint
    if not summary.stop_signal and checkpoint_cfg.save_at_end and summary.end_step > summary.start_step and (
            not checkpoint_cfg.save_interval or summary.end_step % checkpoint_cfg.save_interval):
        summary.checkpoint = _save(run, summary.end_step, consumed_rows)
    run.observer.close()
    if run.encoder_clock is not None:
        run.encoder_clock.close()
    if checkpoint_cfg.save_hf and summary.checkpoint and run.env.rank == 0 and not summary.stop_signal:
        export = export_hf(cfg.model, cfg.data, summary.checkpoint, run.out_dir / "hf", hf_source=checkpoint_cfg.load_hf)
        logger.write(f"exported HF weights to {export.dst}")
        for line in export.serving_warnings:
            logger.write(line)
    summary.rejects = run.pipeline.reject_counts()
    summary.validation_rejects = run.validation.reject_counts()
    run.validation.close()
    summary.sources = _sources(run)
    if run.balanced is not None:
        summary.balance = run.balanced.balance_counters.as_dict()
    run.pipeline.close()
    summary.wall_s = time.perf_counter() - wall_start
    logger.write(_summary_text(summary, run.out_dir))
    if summary.stop_signal:
        logger.write(_stop_text(summary, run.ckpt_root))


def _summary_text(summary: TrainingSummary, out_dir: Path) -> str:
    losses = [loss for _, loss in summary.losses]
    if not losses:
        return f"nothing to do: already at step {summary.end_step}"
    window = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    rejected = sum(summary.rejects.values())
    reject_text = (f"{rejected} samples rejected ({', '.join(f'{k}: {v}' for k, v in sorted(summary.rejects.items()))}),"
                   f" see {out_dir / 'rejects.jsonl'}" if rejected else "0 samples rejected")
    return (f"done: steps {summary.start_step + 1}-{summary.end_step} in {summary.wall_s:.0f}s | "
            f"loss {first:.4f} (first {window}) -> {last:.4f} (last {window}) | {reject_text}"
            + (_balance_text(summary.balance) if summary.balance else "")
            + (f" | mean sync wait {summary.mean_sync_wait_s:.3f}s/step" if summary.sync_waits else "")
            + _throughput_text(summary.throughput_means())
            + _validation_text(summary, out_dir)
            + (f" | checkpoint {summary.checkpoint}" if summary.checkpoint else ""))


def _validation_text(summary: TrainingSummary, out_dir: Path) -> str:
    """The latest evaluation of each set, and the validation samples rejected."""
    if not summary.validation:
        return ""
    step, results = summary.validation[-1]
    losses = ", ".join(f"{name} {result['loss']:.4f}" for name, result in results.items())
    rejected = {name: sum(counts.values()) for name, counts in summary.validation_rejects.items()
                if sum(counts.values())}
    return (f" | validation loss after step {step}: {losses}"
            + "".join(f" ({name}: {count} samples rejected, see {rejects_file(out_dir, name)})"
                      for name, count in rejected.items()))


def _throughput_text(means: dict) -> str:
    if not means:
        return ""
    mfu, hfu = ("n/a" if means[key] is None else f"{means[key]:.1%}" for key in ("mfu", "hfu"))
    return (f" | {means['model_tflops_per_gpu']:.3g} model TFLOP/s/GPU, MFU {mfu}, HFU {hfu}, "
            f"encoder {means['encoder_flops_share']:.0%} of FLOPs")


def _saves_on_signal(signum: int, cfg: RunConfig) -> bool:
    # SIGTERM is a preemption: the job will not get this allocation back. Ctrl-C is a person who
    # wants the prompt back now; the last periodic checkpoint is what they resume from.
    return signum == signal.SIGTERM and cfg.training.save_on_signal


def _stop_text(summary: TrainingSummary, ckpt_root: Path) -> str:
    saved = summary.checkpoint if summary.checkpoint and summary.checkpoint.endswith(
        step_dir_name(summary.end_step)) else None
    earlier = latest_checkpoint(ckpt_root)
    if saved is None and earlier is None:
        return (f"{signal_name(summary.stop_signal)}: stopped at step {summary.end_step}; no checkpoint "
                f"was saved, so rerun without --resume to start over")
    where = f"checkpoint {saved}" if saved else f"no checkpoint at this step; continues from {earlier}"
    return (f"{signal_name(summary.stop_signal)}: stopped at step {summary.end_step}; "
            f"resume with --resume ({where})")


def _balance_text(balance: dict) -> str:
    text = f" | balance: {balance['applied_steps']} steps applied, {balance['skipped_steps']} skipped"
    if balance["mean_max_over_lb_before"] is not None:
        text += (f", mean max/LB {balance['mean_max_over_lb_before']:.3f} -> "
                 f"{balance['mean_max_over_lb_after']:.3f}")
    return text


def run_training_worker(cfg: RunConfig, resume: bool, command_line: list[str]) -> None:
    """Entry point of one training process (``train.launch``). A run stopped by a signal exits with
    128 + the signal, as a shell reports a signalled process."""
    summary = run_training(cfg, resume=resume, command_line=command_line)
    if summary.stop_signal:
        sys.exit(128 + summary.stop_signal)
