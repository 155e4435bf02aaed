"""The vocabulary of a model family's HF weight map: ``Rule`` rows and the ``Transform``s they use.

A family's table (``<family>/hf_mapping.py``) pairs HF tensor names with its own state-dict names;
the transforms here know both directions (full HF tensors -> one TP rank's megatron tensor, and
every rank's tensors -> the HF ones) and are shared by all families, so ``loongforge convert``
reasons about them (split axes, vocabulary padding) without knowing any family.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

# Megatron pads the vocabulary so the output GEMM splits evenly and stays aligned; 128 keeps Qwen's
# vocabularies (151936 = 128*1187, 152064 = 128*1188) unpadded at every power-of-two TP size,
# so checkpoints do not change shape with TP.
VOCAB_PAD_MULTIPLE = 128


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


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """Smallest size >= vocab_size divisible by lcm(VOCAB_PAD_MULTIPLE, TP)."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


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


class Replicated(Transform):
    """Same tensor on every rank (norms, row-parallel biases)."""

    def shard(self, hf, rank, size):
        return hf[0]

    def unshard(self, shards):
        return [shards[0]]


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


class PatchEmbedding(Transform):
    """Conv3d weight [hidden, C, T, p, p] <-> Linear weight [hidden, C*T*p*p] (replicated)."""

    def __init__(self, conv_shape: tuple[int, ...]):
        self.conv_shape = conv_shape

    def shard(self, hf, rank, size):
        return hf[0].reshape(hf[0].shape[0], -1)

    def unshard(self, shards):
        return [shards[0].reshape(self.conv_shape)]


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
