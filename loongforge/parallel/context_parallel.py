"""Context parallelism (CP): which tokens of a packed row each CP rank holds, and the collectives on them.

megatron-core's packed (thd) convention, which its rotary code and Transformer Engine's CP attention
both expect: every sample of the row (a ``cu_seqlens`` segment, padded by the data pipeline to a
multiple of 2 x CP, ``config.layout.sample_multiple``) is cut into 2 x CP equal chunks, and CP rank
r holds chunks r and 2CP-1-r of every sample, in row order. Under a causal mask a sample's late
chunks attend to more keys than its early ones, so pairing chunk r with chunk 2CP-1-r gives every
rank the same attention work. ``cu_seqlens`` stay those of the whole row on every rank.

Positions are the whole row's, computed per sample before the split (the data pipeline's), and
megatron-core's thd rotary code picks each rank's chunks of them; this module splits the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


def local_token_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[T / CP] row positions of CP rank ``cp_rank``'s tokens, in its local order: per sample,
    chunk ``cp_rank`` then chunk ``2 CP - 1 - cp_rank``. ``cu_seqlens`` [n + 1] covers the row."""
    starts, lengths = _segments(cu_seqlens, cp_size)
    chunks = lengths // (2 * cp_size)  # [n]
    first = starts + cp_rank * chunks
    second = starts + (2 * cp_size - 1 - cp_rank) * chunks
    # Per sample: its two chunks' starts, each repeated over the chunk's length.
    chunk_starts = torch.stack([first, second], dim=1).reshape(-1)  # [2n]
    chunk_lengths = chunks.repeat_interleave(2)  # [2n]
    offsets = torch.arange(int(chunk_lengths.sum())) - torch.repeat_interleave(
        chunk_lengths.cumsum(0) - chunk_lengths, chunk_lengths)
    return torch.repeat_interleave(chunk_starts, chunk_lengths) + offsets


def _segments(cu_seqlens: torch.Tensor, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu_seqlens.detach().to("cpu", torch.long)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    uneven = lengths % (2 * cp_size) != 0
    if bool(uneven.any()):
        raise ValueError(f"context parallelism at CP {cp_size} needs every packed sample padded to a multiple "
                         f"of {2 * cp_size} tokens; got segment lengths {lengths[uneven].tolist()[:4]} "
                         f"(the data pipeline pads them: config.layout.sample_multiple)")
    return starts, lengths


def row_order(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[T]: for the CP ranks' tokens gathered in rank order (rank 0's local tokens, then rank 1's,
    ...), the gathered row that holds each row position: ``gathered[row_order(...)]`` is the row."""
    holder = torch.cat([local_token_index(cu_seqlens, cp_size, rank) for rank in range(cp_size)])  # [T]
    return torch.argsort(holder)


def gather_row(local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup,
               order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T/CP, ...] this rank's tokens -> [T, ...] the whole row, in row order. All-gather over the
    CP group forward; the backward sums every rank's gradient of a token on the rank that holds it
    (reduce-scatter), as Llama 3's CP attention trains its gathered keys and values. ``order``:
    ``row_order`` for this row, when the caller already has it."""
    # lazy: megatron-core's autograd collectives, only where CP runs
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=group)
    if order is None:
        order = row_order(cu_seqlens, group.size())
    return gathered.index_select(0, order.to(gathered.device))


@dataclass(frozen=True)
class ContextShard:
    """This CP rank's share of one packed row: what the training step hands the model with the
    row's tokens cut to this rank (``take``) and the whole row's positions."""

    group: dist.ProcessGroup
    index: torch.Tensor  # [T/CP] row positions of this rank's tokens, in local order
    row_input_ids: torch.Tensor  # [1, T] the whole row's token ids (media placeholders are counted on it)

    @classmethod
    def of_row(cls, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> "ContextShard":
        index = local_token_index(cu_seqlens, group.size(), group.rank()).to(input_ids.device)
        return cls(group=group, index=index, row_input_ids=input_ids)

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def row_length(self) -> int:
        return self.row_input_ids.shape[1]

    def take(self, per_token: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """[b, T] -> [b, T/CP]: this rank's tokens of a per-token tensor (None stays None)."""
        return None if per_token is None else per_token[:, self.index]

    def local_features(self, features: torch.Tensor, token_id: int) -> torch.Tensor:
        """[n, ...] the features of the row's ``token_id`` placeholders, in row order -> [n_local, ...]
        those of the placeholders this rank holds, in its local order."""
        is_placeholder = self.row_input_ids[0] == token_id  # [T]
        slot = is_placeholder.cumsum(0) - 1  # [T] feature row of each placeholder
        held = self.index[is_placeholder[self.index]]  # [n_local] row positions
        return features.index_select(0, slot[held])
