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


def mark_tp_duplicates(module: torch.nn.Module, *, vision_tp: int, replica_block: int) -> None:
    """Clear ``tensor_model_parallel`` on this rank's vision parameters that are copies of another
    language-TP rank's, so that megatron's grad norm counts every vision gradient exactly once.

    megatron-core's ``param_is_not_tensor_parallel_duplicate`` (used by the grad norm, hence by
    clipping and the logged norm, and by the zero count) counts a parameter flagged
    ``tensor_model_parallel`` on every language-TP rank, as a distinct shard, and any other
    parameter on language-TP rank 0 only, as a replica. The optimizers copy the flag onto their
    fp32 main parameters and distributed-optimizer shards, so marking the model covers them all.

    Language-TP rank r holds vision shard ``r % vision_tp`` in replica block ``r // vision_tp``
    (``build_vision_tp_group``). Block 0 (ranks 0 .. vision_tp-1, rank 0 among them) keeps its flags:
    its shards are summed and its replicated parameters counted on rank 0. Every other block holds
    copies of block 0's shards, so its flags are cleared: rank 0 is not in it, so nothing of it is
    counted. With ``vision_tp == 1`` the tower is not sharded at all and is cleared everywhere.
    """
    if vision_tp == 1 or replica_block > 0:
        for param in module.parameters():
            param.tensor_model_parallel = False


def keep_qk_norms_from_tp_sum(module: torch.nn.Module, *, vision_tp: int, decoder_qk_norms: bool) -> None:
    """megatron-core's ``finalize_model_grads`` sums over TP the gradient of every parameter named ``q_layernorm`` or
    ``k_layernorm`` when the decoder has per-head q/k norms (``qk_layernorm``), the tower's too. A vision-TP-1 tower
    is replicated over TP: each rank already holds the whole gradient (or its share, which ``parallel.encoder_dp``
    sums itself), so that sum would multiply its q/k norms' gradients by TP. They are flagged to be averaged over TP
    instead, which leaves a replica's gradient as it is and a share's mean for ``encoder_dp``'s sum. (A vision-TP
    > 1 tower with q/k norms beside such a decoder is refused: ``config.validate``.)"""
    if vision_tp != 1 or not decoder_qk_norms:
        return
    for name, param in module.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            param.average_gradients_across_tp_domain = True

