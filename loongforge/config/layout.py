"""The parallel layout: derived sizes, and the one rule deciding whether a model can run at a layout.

``layout_problems`` is the only check of model sizes against TP / PP / vision TP. A model family
states what it needs as a ``LayoutRule`` (which model sizes each axis splits); config validation,
``loongforge convert`` and the model builder all ask this one function, naming the sizes the way
their user typed them (``LayoutKeys``: config keys, or command-line flags).

The size helpers assume a checked layout and are shared by the dry-run plan and the trainer so
every place derives DP the same way.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from loongforge.config.pipeline_layout import PipelineKeys, pipeline_layout_problems
from loongforge.config.schema import DataConfig, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class ParallelSizes:
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    vision_tensor_parallel: int
    data_parallel: int
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    context_parallel: int = 1

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert shard: the ranks its optimizer state can be sharded over."""
        return self.world_size // (self.pipeline_parallel * self.expert_parallel * self.expert_tensor_parallel)

    @property
    def data_context_parallel(self) -> int:
        """DP x CP: megatron-core's data-parallel-with-context group. CP ranks hold the same weights, so
        gradients are reduced, and the distributed optimizer's master weights and moments sharded, over it."""
        return self.data_parallel * self.context_parallel


def vision_tensor_parallel_size(parallel: ParallelConfig) -> int:
    """Vision TP defaults to the language TP (null in the config)."""
    if parallel.vision_tensor_model_parallel_size is None:
        return parallel.tensor_model_parallel_size
    return parallel.vision_tensor_model_parallel_size


def expert_tensor_parallel_size(parallel: ParallelConfig) -> int:
    """Expert TP defaults to the language TP (null in the config)."""
    if parallel.expert_tensor_parallel_size is None:
        return parallel.tensor_model_parallel_size
    return parallel.expert_tensor_parallel_size


def derive_parallel_sizes(parallel: ParallelConfig, world_size: int | None = None) -> ParallelSizes:
    """TP, PP, CP, vision TP, EP and expert TP from the config; DP = world / (TP x PP x CP), world
    from the launch."""
    world = parallel.world_size if world_size is None else world_size
    model_parallel = (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                      * parallel.context_parallel_size)
    return ParallelSizes(
        world_size=world,
        tensor_parallel=parallel.tensor_model_parallel_size,
        pipeline_parallel=parallel.pipeline_model_parallel_size,
        vision_tensor_parallel=vision_tensor_parallel_size(parallel),
        data_parallel=world // model_parallel,
        expert_parallel=parallel.expert_model_parallel_size,
        expert_tensor_parallel=expert_tensor_parallel_size(parallel),
        context_parallel=parallel.context_parallel_size,
    )


def context_sample_multiple(context_parallel: int) -> int:
    """What context parallelism of ``context_parallel`` ranks needs a packed sample's length to be a
    multiple of: 2 x CP (each sample is cut into 2 x CP equal chunks, rank r holding chunks r and
    2CP-1-r), 1 without CP. ``loongforge pack --context-parallel`` pads by the same rule."""
    return 2 * context_parallel if context_parallel > 1 else 1


def encoder_shared_over_context(parallel: ParallelConfig) -> bool:
    """Whether the CP ranks divide a row's media (``parallel.encoder_cp``): only at CP > 1, and not
    with ``encoder_dp=full``, which divides whole steps over TP x PP instead (each CP rank then
    encodes its group's share)."""
    return parallel.encoder_cp and parallel.context_parallel_size > 1 and parallel.encoder_dp != "full"


def sample_multiple(data: DataConfig, parallel: ParallelConfig) -> int:
    """Tokens every packed sample is padded to a multiple of: ``data.sample_multiple``, or what CP
    needs when it is null. The packer counts a sample at its padded length and the collate pads it:
    one rule for both."""
    return data.sample_multiple or context_sample_multiple(parallel.context_parallel_size)


def row_multiple(data: DataConfig, parallel: ParallelConfig) -> int:
    """What a packed row's length must be a multiple of: every sample's padded length, and each CP
    rank's share split evenly over TP under sequence parallelism."""
    tp = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    return math.lcm(sample_multiple(data, parallel), parallel.context_parallel_size * tp)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


# --------------------------------------------------------------------------------------------
# The layout rule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dim:
    """A model size one parallel axis splits: a ``ModelConfig`` path and how a remedy names it."""

    path: str  # under ``model.``, e.g. "language.num_attention_heads"
    what: str  # e.g. "heads", for "(sizes dividing the heads, ...)"
    aside: str = ""  # shown after the key, e.g. "KV heads" for num_query_groups


@dataclass(frozen=True)
class LayoutRule:
    """What a model family needs of the parallel layout (its ``ModelFamily.layout``)."""

    tensor: tuple[Dim, ...]  # language TP splits each of these
    vision_tensor: tuple[Dim, ...]  # vision TP splits each of these
    # Vision TP groups are cut from the language TP groups, so the vision size divides TP.
    vision_within_tensor: bool = True
    # False: the family's towers run at the language TP size only (vision TP = TP).
    vision_below_tensor: bool = True
    # The ``parallel.encoder_dp`` modes the family implements.
    encoder_dp_modes: tuple[str, ...] = ("none", "tp", "full")
    # Whether the CP group may share each row's media (``parallel.encoder_cp``); False for an encoder that
    # packs each image by its size and so runs whole images where it is.
    encoder_cp: bool = True


@dataclass(frozen=True)
class LayoutKeys:
    """How the layout settings are named in messages: config keys, or a command's flags."""

    tensor: str = "parallel.tensor_model_parallel_size"
    pipeline: str = "parallel.pipeline_model_parallel_size"
    vision_tensor: str = "parallel.vision_tensor_model_parallel_size"
    virtual: str = "parallel.virtual_pipeline_model_parallel_size"
    pipeline_layout: str = "parallel.pipeline_layout"


# What megatron's layers need of the schema's three sections: TP splits attention heads, KV heads and
# the MLP; vision TP splits the ViT's heads and MLP (the pipeline's split of the decoder layers is
# ``config.pipeline_layout``'s). A family whose
# layers need more states its own rule; config loading, which knows no family, checks this one.
DECODER_LAYOUT = LayoutRule(
    tensor=(Dim("language.num_attention_heads", "heads"),
            Dim("language.num_query_groups", "KV heads", aside="KV heads"),
            Dim("language.ffn_hidden_size", "FFN size"),
            # Experts' MLPs are split by the expert TP size (config.validate's expert layout).
            ),
    vision_tensor=(Dim("vision.num_heads", "vision heads"),
                   Dim("vision.intermediate_size", "vision MLP size")),
)


def layout_problems(model_cfg: ModelConfig, rule: LayoutRule, *, tp: int, pp: int,
                    vision_tp: int | None, vp: int | None = None, pipeline_layout: str | None = None,
                    keys: LayoutKeys = LayoutKeys()) -> list[str]:
    """One sentence per way the layout does not fit the model; ``vision_tp=None`` follows TP;
    ``vp`` and ``pipeline_layout`` as ``parallel.virtual_pipeline_model_parallel_size`` and
    ``parallel.pipeline_layout``.

    A vision size inherited from a bad TP would repeat TP's complaint, so it is checked only once
    TP fits (or when it was given explicitly)."""
    sizes = {keys.tensor: tp, keys.pipeline: pp, keys.vision_tensor: vision_tp}
    below_one = [f"{key}={size} must be at least 1." for key, size in sizes.items()
                 if size is not None and size < 1]
    if below_one:
        return below_one  # every check below divides by these sizes
    errors = _tensor_problems(model_cfg, rule, tp, keys)
    if not errors or vision_tp is not None:
        errors += _vision_problems(model_cfg, rule, tp, vision_tp, keys)
    pipeline = ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                              pipeline_layout=pipeline_layout)
    return errors + _pipeline_problems(model_cfg, pipeline, keys)


def _size(model_cfg: ModelConfig, dim: Dim) -> int:
    return operator.attrgetter(dim.path)(model_cfg)


def _label(dim: Dim) -> str:
    return f"model.{dim.path}" + (f" ({dim.aside})" if dim.aside else "")


def _common_divisors(numbers: list[int]) -> str:
    return ", ".join(str(d) for d in divisors(min(numbers)) if all(n % d == 0 for n in numbers))


def _spoken_list(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _tensor_problems(model_cfg: ModelConfig, rule: LayoutRule, tp: int, keys: LayoutKeys) -> list[str]:
    # An optional size the model leaves unset (null) has nothing to split.
    dims = [(dim, size) for dim in rule.tensor if (size := _size(model_cfg, dim)) is not None]
    valid = _common_divisors([size for _, size in dims])
    what = _spoken_list([dim.what for dim, _ in dims])
    return [f"{keys.tensor}={tp} does not divide {_label(dim)}={size}; set it to one of {valid} "
            f"(sizes dividing the {what})."
            for dim, size in dims if size % tp]


def _vision_problems(model_cfg: ModelConfig, rule: LayoutRule, tp: int, vision_tp: int | None,
                     keys: LayoutKeys) -> list[str]:
    if model_cfg.vision is None:  # a text-only model: nothing for a vision TP to split
        return [] if vision_tp is None else [
            f"{keys.vision_tensor}={vision_tp} is set but the model has no vision tower (model.vision is "
            f"null); leave it unset."]
    if not rule.vision_below_tensor and vision_tp not in (None, tp):
        return [f"{keys.vision_tensor}={vision_tp}: this model's vision tower runs at the language TP size "
                f"only; leave it unset or set it to {tp}."]
    source = f" (inherited from {keys.tensor})" if vision_tp is None else ""
    vision_tp = tp if vision_tp is None else vision_tp
    named = {_label(dim): _size(model_cfg, dim) for dim in rule.vision_tensor}
    if rule.vision_within_tensor:
        named[keys.tensor] = tp
    valid = _common_divisors(list(named.values()))
    return [f"vision tensor parallel size {vision_tp}{source} does not divide {name}={size}; "
            f"set {keys.vision_tensor} to one of {valid}."
            for name, size in named.items() if size % vision_tp]


def _pipeline_problems(model_cfg: ModelConfig, pipeline: ParallelConfig, keys: LayoutKeys) -> list[str]:
    """The pipeline's split of the decoder layers; DeepStack (``model.vision.deepstack_layers``, k
    entries) adds vision features after decoder layers 0..k-1, which must be on the first stage."""
    layers = model_cfg.language.num_layers
    wanted = len(model_cfg.vision.deepstack_layers) if model_cfg.vision is not None else 0
    if layers < wanted:
        return [f"model.vision.deepstack_layers has {wanted} entries, added after the first {wanted} "
                f"decoder layers, but model.language.num_layers={layers}; use at least {wanted} layers "
                f"or fewer deepstack_layers."]
    return pipeline_layout_problems(
        layers, pipeline, first_stage_layers=wanted,
        first_stage_reason="DeepStack (model.vision.deepstack_layers) adds vision features after",
        keys=PipelineKeys(pipeline=keys.pipeline, virtual=keys.virtual, layout=keys.pipeline_layout),
        mtp_layers=model_cfg.language.mtp_num_layers)


def resolve_read(data_cfg: DataConfig, dp_size: int) -> str:
    """``data.read`` with ``auto`` resolved: ``sharded`` for raw files at DP > 1 (lengths are known
    only after tokenizing, so each rank loads 1/DP of the data and balancing exchanges samples),
    ``global`` otherwise (a packed manifest or the generator gives every rank every length)."""
    if data_cfg.read != "auto":
        return data_cfg.read
    return "sharded" if data_cfg.source == "files" and dp_size > 1 else "global"


@dataclass(frozen=True)
class DataParallelSettings:
    """What megatron-core's DDP wrapper and optimizer are built with (``data_parallel_settings``)."""

    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool

    def describe(self) -> str:
        """The run log's and the dry run's words for them."""
        words = [name for name, on in (("distributed optimizer", self.distributed_optimizer),
                                       ("overlapped grad reduce", self.overlap_grad_reduce),
                                       ("overlapped param gather", self.overlap_param_gather)) if on]
        return ", ".join(words) if words else "plain (all-reduce, after the backward)"


def data_parallel_settings(parallel: ParallelConfig, data_context_parallel: int,
                           saved_distributed_optimizer: bool | None = None) -> DataParallelSettings:
    """``parallel.use_distributed_optimizer``, ``overlap_grad_reduce`` and ``overlap_param_gather``
    with null resolved: the first two on where gradients are reduced over ``data_context_parallel``
    (DP x CP) > 1 ranks, off at 1, where no state is replicated and no reduction runs; the param gather
    only where set (below). A set value wins; the param gather overlaps only the distributed
    optimizer's all-gather, so it is off without it.

    ``saved_distributed_optimizer``: whether the checkpoint a run resumes holds the distributed
    optimizer's state (None: no checkpoint, or one without optimizer state). A null setting then
    follows the checkpoint, at any DP size: megatron-core loads each optimizer's state only into its
    own kind (``train.checkpoint.check_optimizer_kind`` refuses a set value that differs)."""
    replicated = data_context_parallel > 1

    def chosen(value: bool | None) -> bool:
        return replicated if value is None else value

    distributed = parallel.use_distributed_optimizer
    if distributed is None and saved_distributed_optimizer is not None:
        distributed = saved_distributed_optimizer
    distributed = chosen(distributed)
    # The param gather stays opt-in: megatron-core waits for a bucket's weights in the forward pre-hook
    # of the module that owns them, so a weight read outside its own module's forward (LoRA adapters
    # before their fix, a parent reading a child's parameter) would be the previous step's.
    return DataParallelSettings(distributed_optimizer=distributed,
                                overlap_grad_reduce=chosen(parallel.overlap_grad_reduce),
                                overlap_param_gather=distributed and bool(parallel.overlap_param_gather))
