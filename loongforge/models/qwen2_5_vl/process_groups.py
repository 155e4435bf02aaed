"""Process groups of the vision tower, built explicitly from the language model's.

The ViT may use a smaller tensor-parallel size than the language model (it is small and its
sequence is short, so TP communication can cost more than it saves). ``vision_tp`` must divide the
language TP size; each language TP group is cut into consecutive blocks of ``vision_tp`` ranks. With
``vision_tp == 1`` every rank holds the whole tower.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def build_vision_tp_group(language_tp_group: dist.ProcessGroup, vision_tp: int) -> dist.ProcessGroup:
    """This rank's vision TP group. Collective: every rank of the job must call it, in the same
    order relative to other group creations, whether or not it holds the vision tower (later
    pipeline stages do not), because ``new_group`` is collective over the world."""
    language_tp = language_tp_group.size()
    if language_tp % vision_tp != 0:
        raise ValueError(f"vision TP size {vision_tp} must divide language TP size {language_tp}")
    if vision_tp == language_tp:
        return language_tp_group
    # Every rank must create every group, so learn all language TP groups, not just our own.
    mine = dist.get_process_group_ranks(language_tp_group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    my_group = None
    for tp_ranks in sorted({tuple(ranks) for ranks in everyone}):
        for start in range(0, language_tp, vision_tp):
            ranks = list(tp_ranks[start : start + vision_tp])
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                my_group = group
    assert my_group is not None
    return my_group


def mark_replicated_over_language_tp(module: torch.nn.Module, vision_tp: int, language_tp: int) -> None:
    """Tell megatron's grad-norm / optimizer code which vision parameters are TP duplicates.

    megatron counts a parameter once per TP group unless it has ``tensor_model_parallel=True``.
    With vision TP 1 under language TP > 1 the ViT's linear weights are replicated across the
    language TP group, so their ``tensor_model_parallel`` flag must be cleared. (Sizes strictly
    between 1 and the language TP shard *and* replicate; megatron has no flag for that, so the
    grad norm over-counts those weights by language_tp / vision_tp.)
    """
    if vision_tp == 1 and language_tp > 1:
        for param in module.parameters():
            param.tensor_model_parallel = False
