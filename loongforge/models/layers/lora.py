"""LoRA: low-rank adapters on megatron-core's column- and row-parallel linears, PEFT's math and names.

An adapted linear computes ``y = W x + (alpha / r) * B A dropout(x)`` (PEFT's ``LoraLayer`` with its
default scaling), A initialised as PEFT does (kaiming-uniform, a = sqrt(5)), B zeros, so a new
adapter changes nothing. The base weights are frozen; only A and B train.

Fused linears. Megatron fuses HF linears that PEFT adapts one by one: ``linear_qkv`` holds q, k, v
(interleaved per query group), ``linear_fc1`` gate and up (SwiGLU). One PEFT adapter per HF linear
has its own A, so a fused linear of P parts carries A [P*r, K] (the parts' A stacked) and B [N, r]
whose rows follow the fused weight's rows: row n of B is row n of its part's B, and it reads only its
part's r columns of ``A x`` (``LoraAdapter.fused_B`` spreads B into the block matrix [N, P*r]). B's
rows are fused and split exactly as the weight's rows are, by the family's own HF weight map
(``ModelFamily.hf_rules``), so q/k/v interleaving, gate/up halves and the vision tower's per-head qkv
need no code of their own here; ``lora_rules`` turns the weight map into the adapters' map, which
``hf_weights.hf_to_megatron`` / ``megatron_to_hf`` walk to read or write PEFT's tensors.

Tensor parallelism (the weight's split decides the adapter's):
- column-parallel (qkv, fc1): A [P*r, K] whole on every rank, B [N/tp, r] split like the weight's
  rows. ``A x`` is all-gathered along the sequence under sequence parallelism (A then sees this rank's
  tokens only: its gradient is summed over TP by megatron's ``finalize_model_grads``, as for every
  parameter marked ``sequence_parallel``), else copied into the TP region (its gradient all-reduced
  over TP, as B's rows are split).
- row-parallel (proj, fc2): A [r, K/tp] split by columns like the weight, B [N, r] whole. The r-wide
  ``A x`` of each rank is a partial sum: it is all-reduced over TP (reduce-scattered along the
  sequence under sequence parallelism, B then marked ``sequence_parallel``) before B, and the update is
  added after the base's own output reduction.
- routed experts' linears (``lora.experts``): each expert whole on a rank (validated), no
  communication.
Each adapter's parameters carry the attributes its weight carries (``_mark_parallel``): megatron's
tensor-parallel ones on the split matrix, the experts' ``allreduce``, the encoder replicas' marks.
A's initial values are drawn from the training seed and the layer's global name, so they do not
depend on the TP, PP or EP layout.

Checkpoints: the adapters are parameters of the model, saved and resumed with it; an adapted linear
describes its split matrix as TP-sharded (fc1's B as two halves, as megatron saves the fused gate/up
weight) so that a checkpoint reshards to another TP size (``_sharded_state_dict``).

Names: an adapter is the child ``lora`` of its linear, ``<linear>.lora.A`` and ``<linear>.lora.B``
(``state_dict_names.LORA_A`` / ``LORA_B``); PEFT's are ``<hf linear>.lora_A.weight`` /
``lora_B.weight`` (``peft_name``).
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from loongforge.config.errors import InputError
from loongforge.config.schema import LoraConfig, ModelConfig
from loongforge.config.validate import LORA_TE_REFUSAL
from loongforge.models.hf.rules import GateUp, Rule, Tensor, Transform
from loongforge.models.hf.weights import expert_placement, match_rule
from loongforge.models.layers.layer_kinds import layer_kind
from loongforge.models.layers.lora_params import (
    block_b,
    chosen_kinds,
    is_column_rule,
    part_rows,
    per_expert_transform,
    row_parts,
)
from loongforge.models.registry import get_family
from loongforge.models.hf.state_dict_names import LORA_ADAPTED, is_adapter_key
from loongforge.parallel.encoder_dp import GROUP_ATTR as ENCODER_DP_GROUP

_WEIGHT = ".weight"


# ---------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one megatron linear (this rank's shard): ``adapter(x)`` is what is added
    to the linear's output (called as a module, so that hooks on it run: megatron's overlapped param
    gather waits for a bucket's weights in the forward pre-hook of the module that owns them). ``parallel`` is "column" or "row"; ``row_parts`` [N_local] says which of
    the ``parts`` fused parts each output row of a column-parallel linear belongs to (None: one part).
    ``communicates``: TP > 1 and the linear does its own TP communication (an expert's does not)."""

    def __init__(self, A: Tensor, B: Tensor, *, parallel: str, scaling: float, dropout: float, parts: int,
                 row_parts: Optional[Tensor], tp_group, sequence_parallel: bool, communicates: bool):
        super().__init__()
        self.A = torch.nn.Parameter(A)  # column: [P*r, K]; row: [r, K/tp]
        self.B = torch.nn.Parameter(B)  # column: [N/tp, r]; row: [N, r]
        self.parallel, self.scaling = parallel, scaling
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.tp_group, self.sequence_parallel, self.communicates = tp_group, sequence_parallel, communicates
        # [N_local, P]: 1 where a row belongs to a part; not saved (it follows from the layout).
        mask = None if parts == 1 else F.one_hot(row_parts, parts).to(B.dtype)
        self.register_buffer("part_mask", mask, persistent=False)

    def fused_B(self) -> Tensor:
        """B as the block matrix [N_local, P*r] whose row n holds B's row n in its part's r columns."""
        return block_b(self.B, self.part_mask)  # [N_local, P*r]

    def forward(self, x: Tensor) -> Tensor:
        """column: x [s(/tp), b, K] -> [s, b, N/tp]; row: x [s, b, K/tp] -> [s(/tp), b, N]."""
        # The dropout draws from the default generator, seeded alike on every rank (train.runner):
        # without sequence parallelism the TP ranks of a column-parallel linear see the same tokens
        # and must drop the same inputs, or their ``A x`` would differ.
        low = F.linear(self.dropout(x), self.A)  # column [s(/tp), b, P*r]; row [s, b, r] (partial sum)
        if self.communicates:
            low = self._column_comm(low) if self.parallel == "column" else self._row_comm(low)
        weight = self.fused_B() if self.parallel == "column" else self.B
        return F.linear(low, weight) * self.scaling

    def _column_comm(self, low: Tensor) -> Tensor:
        # B's rows are split: each rank's dL/d(Ax) is a part of the sum, added up in the backward.
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(low, group=self.tp_group)  # [s, b, P*r]
        return copy_to_tensor_model_parallel_region(low, group=self.tp_group)

    def _row_comm(self, low: Tensor) -> Tensor:
        # A's columns are split: each rank holds a partial sum of A x over its input channels.
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(low, group=self.tp_group)  # [s/tp, b, r]
        return reduce_from_tensor_model_parallel_region(low, group=self.tp_group)  # [s, b, r]

    def delta_weight(self) -> Tensor:
        """The update as a change of this rank's weight shard, ``scaling * B A``: column [N/tp, K],
        row [N, K/tp] (the full delta's shard either way)."""
        return (self.fused_B() @ self.A) * self.scaling

    def extra_repr(self) -> str:
        return f"{self.parallel}, A={list(self.A.shape)}, B={list(self.B.shape)}, scaling={self.scaling:g}"


def _column_impl(original, adapter: LoraAdapter, *args, **kwargs) -> Tensor:
    """A column-parallel linear's ``_forward_impl`` plus the update: it gets the linear's input after
    a fused pre-norm and before the sequence-parallel gather, as the base GEMM does."""
    x = kwargs["input"] if "input" in kwargs else args[0]
    return original(*args, **kwargs) + adapter(x)


def _row_forward(original, adapter: LoraAdapter, input_: Tensor):
    """A row-parallel linear's ``forward`` plus the update, after the base's output reduction."""
    output, bias = original(input_)
    return output + adapter(input_), bias


# ---------------------------------------------------------------------------------------------
# Attaching adapters to a built model
# ---------------------------------------------------------------------------------------------


def apply_lora(model: torch.nn.Module, model_cfg: ModelConfig, lora_cfg: LoraConfig, *,
               seed: int) -> dict[str, int]:
    """Attach an adapter to every linear of the kinds ``lora_cfg`` chooses (A from ``seed`` and the
    layer's global name: the same at every TP, PP and EP size; B zeros) and freeze every other
    parameter of ``model`` (one built pipeline stage of any family). Returns the count of adapted
    linears per kind. A Transformer Engine linear is refused (``model.layer_backend=te``)."""
    rules = get_family(model_cfg.family).hf_rules(model_cfg)
    hf_shapes = get_family(model_cfg.family).hf_shapes(model_cfg)
    kinds, counts = chosen_kinds(lora_cfg), {}
    global_name = _global_names(model)
    for name, module in list(model.named_modules()):
        kind = layer_kind(name)
        if kind not in kinds:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            raise InputError(LORA_TE_REFUSAL + f" ({name} is {type(module).__name__})")
        rule, _, _ = match_rule(rules, global_name(name) + _WEIGHT)  # the layer's own kind's rule
        _attach(module, _make_adapter(module, rule, hf_shapes, lora_cfg, _name_seed(seed, global_name(name))))
        counts[kind] = counts.get(kind, 0) + 1
    freeze_base(model)
    setattr(model, LORA_ADAPTED, True)
    return dict(sorted(counts.items()))


def freeze_base(model: torch.nn.Module) -> None:
    """Every parameter but the adapters' takes no gradient (and so gets no gradient buffer or
    optimizer state in megatron's DDP and optimizer, which keep trainable parameters only)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name))


def _global_names(model: torch.nn.Module) -> Callable[[str], str]:
    """A module name -> the same name with the decoder layer and expert indices of the whole model
    (megatron numbers them within the pipeline stage and the expert-parallel rank)."""
    layers = model.language_model.decoder.layers
    layer_offset = layers[0].layer_number - 1 if len(layers) else 0
    experts = expert_placement(layers)
    expert_offset = experts.offset if experts else 0

    def renumber(name: str) -> str:
        name = re.sub(r"^language_model\.decoder\.layers\.(\d+)\.",
                      lambda found: f"language_model.decoder.layers.{int(found[1]) + layer_offset}.", name)
        return re.sub(r"\.local_experts\.(\d+)\.", lambda found: f".local_experts.{int(found[1]) + expert_offset}.", name)

    return renumber


def _name_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63  # stable across processes


def _attach(module: torch.nn.Module, adapter: LoraAdapter) -> None:
    module.lora = adapter
    if adapter.parallel == "column":
        module._forward_impl = functools.partial(_column_impl, module._forward_impl, adapter)
    else:
        module.forward = functools.partial(_row_forward, module.forward, adapter)
    if adapter.communicates:
        module.sharded_state_dict = functools.partial(_sharded_state_dict, module.sharded_state_dict, adapter)


def _sharded_state_dict(original, adapter: LoraAdapter, prefix: str = "", sharded_offsets: tuple = (),
                        metadata: Optional[dict] = None) -> dict:
    """The linear's checkpoint entries with its adapter's split matrix as a TP-sharded tensor of the
    whole shape: megatron's linear knows only ``weight`` and ``bias`` and would record any other
    tensor as replicated (one rank's shard saved as the whole)."""
    sharded = original(prefix, sharded_offsets, metadata)
    name, axis = ("lora.B", 0) if adapter.parallel == "column" else ("lora.A", 1)
    split = adapter.B if adapter.parallel == "column" else adapter.A
    entry = make_sharded_tensors_for_checkpoint(
        {name: split}, prefix, {name: axis}, sharded_offsets, tp_group=adapter.tp_group,
        dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])[prefix + name]
    if adapter.gate_up_rows:
        # Each rank's rows are [its gate shard, its up shard], as the fused weight's: megatron's MLP
        # saves that weight as two separately sharded halves, so that another TP size reads it.
        entry = apply_swiglu_sharded_factory(entry, sharded_offsets,
                                             (metadata or {}).get("singleton_local_shards", False))
    sharded[prefix + name] = entry
    return sharded


def _make_adapter(module, rule: Rule, hf_shapes: dict, lora_cfg: LoraConfig, seed: int) -> LoraAdapter:
    """The adapter of one linear (``rule``: its weight's row of the family's map), this rank's shards."""
    weight, group = module.weight, module.tp_group
    column, rows = is_column_rule(rule), part_rows(rule, hf_shapes)
    A, B = _initial_matrices(weight, per_expert_transform(rule.transform), column, len(rows), lora_cfg.rank,
                             group.rank(), group.size(), torch.Generator().manual_seed(seed))
    parts_of_rows = row_parts(rule, hf_shapes, group.rank(), group.size()) if column else None
    # An expert's linear leaves its TP communication to the token dispatcher (explicit_expert_comm).
    explicit = getattr(module, "explicit_expert_comm", False)
    adapter = LoraAdapter(A.to(weight.device, weight.dtype), B.to(weight.device, weight.dtype),
                          parallel="column" if column else "row", scaling=lora_cfg.alpha / lora_cfg.rank,
                          dropout=lora_cfg.dropout, parts=len(rows) if column else 1,
                          row_parts=None if parts_of_rows is None else parts_of_rows.to(weight.device), tp_group=group,
                          sequence_parallel=bool(module.sequence_parallel) and not explicit,
                          communicates=not explicit and group.size() > 1)
    _mark_parallel(adapter, weight)
    adapter.gate_up_rows = column and isinstance(per_expert_transform(rule.transform), GateUp)
    return adapter


def _initial_matrices(weight: Tensor, transform: Transform, column: bool, parts: int, r: int,
                      rank: int, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(A, B) of this rank, fp32 on the CPU: A drawn whole (the same at every TP size) and split like
    the weight's columns where the weight's columns are split, B zeros."""
    if not column:
        A = transform.shard([kaiming_uniform_a(r, weight.shape[1] * size, generator)], rank, size)  # [r, K/tp]
        return A, torch.zeros(weight.shape[0], r)  # B [N, r]
    A = torch.cat([kaiming_uniform_a(r, weight.shape[1], generator) for _ in range(parts)])  # [P*r, K]
    return A, torch.zeros(weight.shape[0], r)  # B [N/tp, r]


# What the family and megatron mark on a linear's weight at build time and the adapter must carry too:
# megatron's DDP reduces a parameter with ``allreduce`` False (an expert's under expert parallelism)
# over the expert-data-parallel group; the grad norm leaves out ``shared`` ones (an encoder replica
# on a later pipeline stage); ``parallel.encoder_dp=tp`` sums the gradients of the encoder's marked
# parameters over the ranks that divided its media.
_INHERITED = ("allreduce", "shared", ENCODER_DP_GROUP)
_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _mark_parallel(adapter: LoraAdapter, weight: Tensor) -> None:
    """The parameter attributes megatron and the families read: the matrix split like the weight
    (column B, row A) takes the weight's tensor-parallel ones (the grad norm counts a split
    parameter on every rank and a whole one once; a family clears them on vision replicas), the one
    that sees sequence-split tokens is ``sequence_parallel`` (its gradient summed over TP by
    ``finalize_model_grads``), both take ``_INHERITED``."""
    split, whole = (adapter.B, adapter.A) if adapter.parallel == "column" else (adapter.A, adapter.B)
    for name in _TP_ATTRIBUTES:
        if hasattr(weight, name):
            setattr(split, name, getattr(weight, name))
    if adapter.sequence_parallel:
        whole.sequence_parallel = True
    for name in _INHERITED:
        if hasattr(weight, name):
            setattr(adapter.A, name, getattr(weight, name))
            setattr(adapter.B, name, getattr(weight, name))


def kaiming_uniform_a(rows: int, in_features: int, generator: torch.Generator) -> Tensor:
    """PEFT's initial lora_A [rows, in_features]: ``kaiming_uniform_(a=sqrt(5))``, i.e. uniform on
    +-1/sqrt(in_features), drawn in fp32 from ``generator``."""
    bound = math.sqrt(6.0 / ((1 + 5) * in_features))  # gain sqrt(2 / (1 + a^2)) * sqrt(3 / fan_in)
    return (torch.rand(rows, in_features, generator=generator) * 2 - 1) * bound


def adapters(model: torch.nn.Module) -> dict[str, LoraAdapter]:
    """Every adapter of ``model`` by its linear's module name."""
    return {name[: -len(".lora")]: module for name, module in model.named_modules()
            if isinstance(module, LoraAdapter)}


@torch.no_grad()
def merge_adapters(model: torch.nn.Module) -> None:
    """Fold every adapter into its base weight (``W += scaling * B A``) and zero its B, so the model
    computes the same with adapters that no longer add anything: a merged model to export."""
    for name, adapter in adapters(model).items():
        weight = model.get_submodule(name).weight
        weight.add_(adapter.delta_weight().to(weight.dtype))
        adapter.B.zero_()


def describe_lora(counts: dict[str, int], model: torch.nn.Module) -> str:
    """``lora: language.fc1 2, language.qkv 2 ...; 12,288 trainable parameters of 1,234,567 on this rank``."""
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = ", ".join(f"{kind} {count}" for kind, count in counts.items())
    return f"lora: {layers}; {trainable:,} trainable parameters of {sum(p.numel() for p in params):,} on this rank"
