"""The vocabulary of a model family's HF weight map: ``Rule`` rows and the ``Transform``s they use.

A family's table (``<family>/hf_mapping.py``) pairs HF tensor names with its own state-dict names;
the transforms here know both directions (full HF tensors -> one TP rank's megatron tensor, and
every rank's tensors -> the HF ones) and are shared by all families, so ``loongforge convert``
reasons about them (split axes, vocabulary padding) without knowing any family.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from loongforge.models.decoder.vocab import padded_vocab_size


def rename_prefixes(state: Mapping[str, Any], pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Keys starting with a pair's first prefix get its second instead (the first pair that
    matches); other keys unchanged. How a family maps the key styles it reads to the one it writes."""
    renamed = {}
    for key, value in state.items():
        for old, new in pairs:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed[key] = value
    return renamed


def rename_rule(rule: "Rule", pairs: Sequence[tuple[str, str]]) -> "Rule":
    """``rule`` with its HF patterns (and fallback) renamed by ``rename_prefixes``' rule: rows built in one
    key style, used in a family's own."""
    def renamed(key: str) -> str:
        return next(iter(rename_prefixes({key: None}, pairs)))

    fallback = None if rule.fallback_hf is None else renamed(rule.fallback_hf)
    return dataclasses.replace(rule, hf=tuple(renamed(pattern) for pattern in rule.hf), fallback_hf=fallback)


Tensor = torch.Tensor
LANGUAGE, VISION = "language", "vision"


# ---------------------------------------------------------------------------------------------
# Transforms: shard (HF full tensors -> one rank's tensor) and unshard (all ranks -> HF tensors)
# ---------------------------------------------------------------------------------------------


class Transform(abc.ABC):
    """How one megatron tensor is made from HF tensors (``shard``) and back (``unshard``)."""

    @abc.abstractmethod
    def shard(self, hf: Sequence[Tensor], rank: int, size: int) -> Tensor:
        """HF full tensors -> this TP rank's megatron tensor."""

    @abc.abstractmethod
    def unshard(self, shards: Sequence[Tensor]) -> list[Tensor]:
        """Every TP rank's megatron tensor -> the HF full tensors."""

    def accepts_hf_shape(self, shape: tuple[int, ...]) -> bool:
        """Whether an HF file's tensor of ``shape`` can be read where the config implies another
        shape (a layout the transform also reads); only ``FusedExperts`` has one."""
        return False

    def as_written(self, hf: Sequence[Tensor]) -> list[Tensor]:
        """HF tensors as ``unshard`` writes them back (the same values; another layout only where
        ``accepts_hf_shape`` read one)."""
        return list(hf)


class Replicated(Transform):
    """Same tensor on every rank (norms, row-parallel biases)."""

    def shard(self, hf, rank, size):
        return hf[0]

    def unshard(self, shards):
        return [shards[0]]


class Transposed(Transform):
    """An HF matrix stored transposed (ERNIE-4.5-VL's routers, [hidden, experts]), the same on every rank."""

    def shard(self, hf, rank, size):
        return hf[0].t().contiguous()

    def unshard(self, shards):
        return [shards[0].t().contiguous()]


@dataclass(frozen=True)
class Split(Transform):
    """Column-parallel (dim 0) or row-parallel (dim 1) split into equal contiguous chunks."""

    dim: int

    def shard(self, hf, rank, size):
        return _chunk(hf[0], size, self.dim)[rank]

    def unshard(self, shards):
        return [torch.cat(list(shards), dim=self.dim)]


@dataclass(frozen=True)
class Vocab(Transform):
    """Embedding / output rows: pad the vocabulary with zero rows, then split along dim 0."""

    vocab_size: int

    def shard(self, hf, rank, size):
        full = hf[0][: self.vocab_size]
        padding = full.new_zeros(padded_vocab_size(self.vocab_size, size) - full.shape[0], *full.shape[1:])
        return _chunk(torch.cat([full, padding]), size, 0)[rank]

    def unshard(self, shards):
        return [torch.cat(list(shards))[: self.vocab_size]]


@dataclass(frozen=True)
class Copies(Transform):
    """One megatron tensor that the HF checkpoint stores ``copies`` times (DeepSeek's multi-token-prediction
    layer keeps its own copy of the embedding and of the output head): read from the first HF key, written
    to every one."""

    base: Transform
    copies: int

    def shard(self, hf, rank, size):
        return self.base.shard(hf[:1], rank, size)

    def unshard(self, shards):
        (tensor,) = self.base.unshard(shards)
        return [tensor] + [tensor.clone() for _ in range(self.copies - 1)]


@dataclass(frozen=True)
class GroupedQKV(Transform):
    """HF q, k, v (weights [out, in] or biases [out]) <-> megatron's per-group interleaved qkv."""

    num_heads: int
    num_groups: int
    head_dim: int

    def shard(self, hf, rank, size):
        return _chunk(self.interleave(*hf), size, 0)[rank]

    def unshard(self, shards):
        return self.deinterleave(torch.cat(list(shards)))

    def interleave(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g, r, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        rest = q.shape[1:]
        # [g, r*d | d | d, ...] -> [g*(r+2)*d, ...]
        return torch.cat(
            [q.reshape(g, r * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
        ).reshape(g * (r + 2) * d, *rest)

    def deinterleave(self, qkv: Tensor) -> list[Tensor]:
        g, r, d = self.num_groups, self.num_heads // self.num_groups, self.head_dim
        rest = qkv.shape[1:]
        q, k, v = qkv.reshape(g, (r + 2) * d, *rest).split([r * d, d, d], dim=1)
        return [q.reshape(g * r * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]


@dataclass(frozen=True)
class GroupedRows(Transform):
    """HF tensors cut into row segments <-> megatron's one tensor holding, group by group, each segment's
    rows of that group: ``[seg_0 of group 0, seg_1 of group 0, ..., seg_0 of group 1, ...]``.

    ``segments`` gives each HF tensor's segments (their row counts, in order); every segment splits into
    ``groups`` equal blocks. Gated DeltaNet's projections group by key head (q, k of one key head with the
    value heads it serves), so TP's contiguous split of the megatron tensor gives each rank whole groups
    and the layout is the same at every TP size (``GroupedQKV`` is the case of one segment per tensor)."""

    groups: int
    segments: tuple[tuple[int, ...], ...]

    def shard(self, hf, rank, size):
        return _chunk(self.interleave(hf), size, 0)[rank]

    def unshard(self, shards):
        return self.deinterleave(torch.cat(list(shards)))

    def _blocks(self) -> list[int]:
        return [rows // self.groups for sizes in self.segments for rows in sizes]

    def interleave(self, hf: Sequence[Tensor]) -> Tensor:
        pieces = [piece for tensor, sizes in zip(hf, self.segments) for piece in tensor.split(list(sizes))]
        rest = hf[0].shape[1:]
        # each piece [groups * block, ...] -> [groups, block, ...]; concatenated per group
        grouped = torch.cat([piece.reshape(self.groups, -1, *rest) for piece in pieces], dim=1)
        return grouped.reshape(-1, *rest)

    def deinterleave(self, rows: Tensor) -> list[Tensor]:
        rest = rows.shape[1:]
        pieces = rows.reshape(self.groups, -1, *rest).split(self._blocks(), dim=1)
        pieces = [piece.reshape(-1, *rest) for piece in pieces]
        tensors, start = [], 0
        for sizes in self.segments:
            tensors.append(torch.cat(pieces[start:start + len(sizes)]))
            start += len(sizes)
        return tensors


@dataclass(frozen=True)
class GatedGroupedQKV(Transform):
    """HF q_proj holding each head's query then its output gate ([heads, 2, head_dim] rows), k_proj, v_proj
    <-> megatron's gated linear_qkv: per query group its heads' queries, their gates, its key, its value
    (``attention_output_gate``)."""

    num_heads: int
    num_groups: int
    head_dim: int

    def _grouped(self) -> GroupedRows:
        q, kv = self.num_heads * self.head_dim, self.num_groups * self.head_dim
        return GroupedRows(self.num_groups, ((q,), (q,), (kv,), (kv,)))

    def shard(self, hf, rank, size):
        q_and_gate, k, v = hf
        rest = q_and_gate.shape[1:]
        query, gate = q_and_gate.reshape(self.num_heads, 2, self.head_dim, *rest).unbind(1)
        parts = [query.reshape(-1, *rest), gate.reshape(-1, *rest), k, v]
        return _chunk(self._grouped().interleave(parts), size, 0)[rank]

    def unshard(self, shards):
        query, gate, k, v = self._grouped().deinterleave(torch.cat(list(shards)))
        rest = query.shape[1:]
        per_head = [x.reshape(self.num_heads, 1, self.head_dim, *rest) for x in (query, gate)]
        return [torch.cat(per_head, dim=1).reshape(-1, *rest), k, v]


@dataclass(frozen=True)
class FusedHeadQKV(Transform):
    """HF vision qkv [3*heads*hd, ...] ordered (q|k|v, head) <-> megatron (head, q|k|v)."""

    num_heads: int
    head_dim: int

    def shard(self, hf, rank, size):
        x = hf[0]
        per_head = x.reshape(3, self.num_heads, self.head_dim, *x.shape[1:]).transpose(0, 1)
        return _chunk(per_head.reshape(x.shape), size, 0)[rank]

    def unshard(self, shards):
        x = torch.cat(list(shards))
        return [x.reshape(self.num_heads, 3, self.head_dim, *x.shape[1:]).transpose(0, 1).reshape(x.shape)]


class GateUp(Transform):
    """HF gate_proj, up_proj <-> megatron linear_fc1 holding [gate shard, up shard] per rank."""

    def shard(self, hf, rank, size):
        gate, up = hf
        return torch.cat([_chunk(gate, size, 0)[rank], _chunk(up, size, 0)[rank]])

    def unshard(self, shards):
        gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards))
        return [torch.cat(gates), torch.cat(ups)]


class Reshaped(Transform):
    """An HF tensor of ``hf_shape`` <-> ours of ``shape``, the same values (replicated): a class token
    [1, 1, h] kept as [h], a position table [1, n, h] as [n, h]."""

    def __init__(self, hf_shape: tuple[int, ...], shape: tuple[int, ...]):
        self.hf_shape, self.shape = hf_shape, shape

    def shard(self, hf, rank, size):
        return hf[0].reshape(self.shape)

    def unshard(self, shards):
        return [shards[0].reshape(self.hf_shape)]


def PatchEmbedding(conv_shape: tuple[int, ...]) -> Reshaped:  # noqa: N802  (reads as the transform it is)
    """A patch embedding's Conv weight [hidden, C, (T,) p, p] <-> our Linear weight [hidden, C*(T*)p*p]."""
    return Reshaped(conv_shape, (conv_shape[0], -1))


@dataclass(frozen=True)
class FusedExperts(Transform):
    """Every expert of one layer in one HF tensor [E, out, in] <-> megatron's per-expert tensors
    (``SequentialMLP``'s ``local_experts.{e}``), each made from its expert's slice by ``per_expert``.

    transformers 5's Qwen3-VL-MoE holds (and ``save_pretrained`` writes) ``experts.gate_up_proj``
    [E, 2*ffn, h] (each expert's gate rows, then its up rows) and ``experts.down_proj`` [E, h, ffn];
    ``expert_shape`` is one expert's [out, in] in that layout. The Hub's Qwen3-VL-MoE files store the
    two trailing axes the other way round ([E, h, 2*ffn], [E, ffn, h]: the batched-matmul layout of
    transformers 4), which is read transposed. A square slice could be either; it is read as
    transformers 5 reads it (its loader transposes only when the shape differs). Written: transformers
    5's layout. ``shard`` / ``unshard`` move all E experts ([E, ...] per rank); ``shard_expert`` one.
    """

    per_expert: Transform  # GateUp for gate_up_proj, Split(1) for down_proj
    num_experts: int
    expert_shape: tuple[int, int]
    # The HF tensors ``per_expert`` takes from one expert's slice: 2 (gate, up) or 1 (down).
    parts: int

    def accepts_hf_shape(self, shape: tuple[int, ...]) -> bool:
        return tuple(shape) in ((self.num_experts, *self.expert_shape), (self.num_experts, *self.expert_shape[::-1]))

    def _experts(self, fused: Tensor) -> Tensor:
        """[E, out, in] whichever layout ``fused`` is in."""
        shape = tuple(fused.shape)
        if shape == (self.num_experts, *self.expert_shape):
            return fused
        if shape == (self.num_experts, *self.expert_shape[::-1]):
            return fused.transpose(1, 2)
        raise ValueError(f"fused expert tensor of shape {list(fused.shape)}: expected "
                         f"[{self.num_experts}, {self.expert_shape[0]}, {self.expert_shape[1]}] or its last two "
                         f"axes swapped")

    def as_written(self, hf):
        return [self._experts(hf[0])]

    def shard_expert(self, hf: Sequence[Tensor], expert: int, rank: int, size: int) -> Tensor:
        """Expert ``expert``'s tensor on TP rank ``rank``."""
        return self.per_expert.shard(list(self._experts(hf[0])[expert].chunk(self.parts, dim=0)), rank, size)

    def shard(self, hf, rank, size):
        return torch.stack([self.shard_expert(hf, e, rank, size) for e in range(self.num_experts)])

    def unshard(self, shards):
        return self.unshard_experts([[shard[e] for shard in shards] for e in range(self.num_experts)])

    def unshard_experts(self, per_expert_shards: Sequence[Sequence[Tensor]]) -> list[Tensor]:
        """[expert][TP rank] megatron tensors -> the fused HF tensor [E, out, in]."""
        return [torch.stack([torch.cat(self.per_expert.unshard(shards)) for shards in per_expert_shards])]


def _chunk(x: Tensor, parts: int, dim: int) -> tuple[Tensor, ...]:
    if x.shape[dim] % parts != 0:
        raise ValueError(f"cannot split a dimension of {x.shape[dim]} into {parts} TP shards")
    return x.chunk(parts, dim=dim)


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # Hub-style key pattern(s); several when megatron fuses tensors
    megatron: str  # our key pattern
    transform: Transform
    group: str  # LANGUAGE or VISION: which TP group shards it
    # HF key to read when ``hf`` is absent (a tied checkpoint has no lm_head.weight).
    fallback_hf: Optional[str] = None
    # How many indices ``{i}`` runs over in a vision rule; None: every vision block.
    count: Optional[int] = None
    # The language layers ``{i}`` runs over (a hybrid decoder's rows of one kind of layer); None: every one.
    layers: Optional[tuple[int, ...]] = None
    # HF numbers these experts from here (``{e}`` in ``hf`` is ours + this): a checkpoint that lists two expert
    # sets in one sequence (ERNIE-4.5-VL's vision experts after its text experts).
    expert_offset: int = 0

    @property
    def fuses_experts(self) -> bool:
        """One HF tensor per layer holds every expert that our ``{e}`` keys hold one by one."""
        return "{e}" in self.megatron and not any("{e}" in pattern for pattern in self.hf)


@dataclass(frozen=True)
class ViTBlockNames:
    """Where an HF ViT block (LayerNorm pre-norms, separate q/k/v, biased linears, plain MLP) keeps
    its tensors, relative to the block's prefix."""

    norm1: str
    q_k_v: str  # holds "{x}" for q, k, v
    out: str
    norm2: str
    fc1: str
    fc2: str


def vit_block_rules(hf_block: str, ours: str, names: ViTBlockNames, heads: int, head_dim: int) -> list[Rule]:
    """A plain ViT block's rows (vision TP): the pre-norms in the fused ``layer_norm_{weight,bias}`` of
    the linear after them, q/k/v as one ``linear_qkv`` per head (``GroupedQKV`` with a group per head),
    the output projection and fc2 row-parallel, fc1 column-parallel. ``hf_block`` / ``ours``: the
    block's prefixes, with ``{i}`` for the layer."""
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = GroupedQKV(heads, heads, head_dim)
    attention, mlp = ours + "self_attention.", ours + "mlp."

    def fused_norm(hf: str, linear: str) -> list[Rule]:
        return [Rule((hf_block + hf + f".{p}",), linear + f".layer_norm_{p}", rep, VISION) for p in ("weight", "bias")]

    def linear(hf: str, megatron: str, weight: Transform, bias: Transform) -> list[Rule]:
        return [Rule((hf_block + hf + ".weight",), megatron + ".weight", weight, VISION),
                Rule((hf_block + hf + ".bias",), megatron + ".bias", bias, VISION)]

    return [
        *fused_norm(names.norm1, attention + "linear_qkv"),
        *(Rule(tuple(hf_block + names.q_k_v.format(x=x) + f".{p}" for x in "qkv"), attention + f"linear_qkv.{p}",
               qkv, VISION) for p in ("weight", "bias")),
        *linear(names.out, attention + "linear_proj", row, rep),
        *fused_norm(names.norm2, mlp + "linear_fc1"),
        *linear(names.fc1, mlp + "linear_fc1", col, col),
        *linear(names.fc2, mlp + "linear_fc2", row, rep),
    ]
