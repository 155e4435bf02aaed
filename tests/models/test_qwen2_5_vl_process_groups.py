"""Vision parameters marked for megatron's grad norm: every vision gradient counted exactly once.

Runs megatron-core's own counting rule (``param_is_not_tensor_parallel_duplicate``) over the ranks
of one language-TP group, without processes; the end-to-end check with real groups and a real
optimizer is the ``tp4-vision-tp2-sp-recompute`` job of ``tests/train/test_layout_invariance.py``.
"""

import pytest
import torch
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from loongforge.models.vlm.process_groups import mark_tp_duplicates


class _Rank:
    """Stands in for the language TP group as megatron's rule sees it: only ``rank()`` is read."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _tower() -> torch.nn.Module:
    tower = torch.nn.Module()
    tower.sharded = torch.nn.Parameter(torch.zeros(2))  # a column/row-parallel weight shard
    tower.sharded.tensor_model_parallel = True
    tower.replicated = torch.nn.Parameter(torch.zeros(2))  # a norm weight, whole on every rank
    tower.replicated.tensor_model_parallel = False
    return tower


@pytest.mark.parametrize("language_tp,vision_tp", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2)])
def test_each_vision_shard_is_counted_once(language_tp, vision_tp):
    counted = []  # (parameter, vision shard) per counting rank
    for rank in range(language_tp):
        tower = _tower()
        mark_tp_duplicates(tower, vision_tp=vision_tp, replica_block=rank // vision_tp)
        for name, param in tower.named_parameters():
            if param_is_not_tensor_parallel_duplicate(param, _Rank(rank)):
                counted.append((name, rank % vision_tp if name == "sharded" else None))
    expected = [("sharded", shard) for shard in range(vision_tp)] + [("replicated", None)]
    assert sorted(counted, key=str) == sorted(expected, key=str)
