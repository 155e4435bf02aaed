"""``StepEncoding`` (``parallel.encoder_dp=full``) on three gloo ranks with a toy encoder: each
micro-batch's slice of the step's features equals encoding it alone, a text-only micro-batch takes
an empty turn, a rank that encodes nothing still takes part, and the encoder gradients every rank
gets back (summed over the group) equal one rank encoding everything and running the backward.
With ``recompute`` the same, and the activations a rank saves for backward are measured: none
while the pipeline runs, at most one micro-batch's at a time in ``finish``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from loongforge.models.vlm.encoder_full import StepEncoding, _media_groups
from loongforge.parallel.media_assign import VisionCost
from tests.models.helpers import free_port, limit_threads, run_workers

WORLD_SIZE = 3
MERGE_UNIT = 4
CHANNELS, WIDTH = 5, 3


def _seeded_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(CHANNELS, WIDTH).double()


def _encode(tower: torch.nn.Linear, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Patch rows [P, C] -> merged rows [P / 4, W]: the 4 patches of a merge unit summed."""
    return tower(pixels).view(-1, MERGE_UNIT, WIDTH).sum(1)


def _micro_batch(grids: list[tuple[int, int, int]], seed: int):
    """(pixels [P, C], grid_thw [n, 3]) of one micro-batch; (None, None) when text only."""
    if not grids:
        return None, None
    grid = torch.tensor(grids)
    patches = int(grid.prod(-1).sum())
    return torch.randn(patches, CHANNELS, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64), grid


# Micro-batches: two images; text only; a video (2 frames); one small image.
STEP = [[(1, 4, 4), (1, 2, 4)], [], [(2, 4, 2)], [(1, 2, 2)]]


def _upstream(rows: int, index: int) -> torch.Tensor:
    """The gradient the language model hands each micro-batch's features: [rows, W]."""
    return torch.linspace(-1, 1, rows * WIDTH, dtype=torch.float64).view(rows, WIDTH) * (index + 1)


def _reference(micro_batches) -> tuple[list, list]:
    """One rank encodes each micro-batch alone: (features per micro-batch, encoder gradients)."""
    tower = _seeded_linear()
    features = []
    for index, (pixels, grid) in enumerate(micro_batches):
        if grid is None:
            features.append(torch.zeros(0, WIDTH, dtype=torch.float64))
            continue
        out = _encode(tower, pixels, grid)
        (out * _upstream(out.shape[0], index)).sum().backward()
        features.append(out.detach())
    return features, [p.grad for p in tower.parameters()]


class SavedBytes:
    """Bytes of the tensors each encoder call saves for its backward (autograd's pack hook)."""

    def __init__(self):
        self.per_call: list[int] = []

    def encode(self, tower, pixels, grid_thw):
        saved = [0]

        def pack(tensor):
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = _encode(tower, pixels, grid_thw)
        self.per_call.append(saved[0])
        return out


def _shared(micro_batches, group, recompute: bool = False, saved: SavedBytes = None) -> tuple[list, list, int]:
    rank = dist.get_rank(group)
    tower = _seeded_linear()
    saved = saved or SavedBytes()
    encoding = StepEncoding(group, role=(rank, 0), receives=rank == 0, merge_unit=MERGE_UNIT,
                            width=WIDTH, dtype=torch.float64, vision_cost=VisionCost, recompute=recompute)
    held = encoding.begin(lambda p, g: saved.encode(tower, p, g), micro_batches, torch.device("cpu"))
    saved_through_the_pipeline = sum(saved.per_call)
    if recompute:
        assert saved_through_the_pipeline == 0, saved.per_call
    features = []
    if rank == 0:  # the first stage embeds: one slice per micro-batch, in order
        for index, (_, grid) in enumerate(micro_batches):
            part = encoding.take(grid)
            (part * _upstream(part.shape[0], index)).sum().backward()
            features.append(part.detach())
        with pytest.raises(RuntimeError, match=f"micro-batch {len(micro_batches) + 1} embedded"):
            encoding.take(None)
    grads = encoding.finish(list(tower.parameters()))
    assert not encoding.active and all(p.grad is None for p in tower.parameters())
    if not recompute:
        assert len(saved.per_call) <= 1  # the whole share's graph, kept from begin to finish
    return features, grads, held


def _worker(rank: int, port: int) -> None:
    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        steps = (STEP, [[(1, 2, 2)], []], [[], []])  # rank 2 (then all) encode nothing
        for step, recompute in [(step, recompute) for recompute in (False, True) for step in steps]:
            micro_batches = [_micro_batch(grids, seed) for seed, grids in enumerate(step)]
            expected_features, expected_grads = _reference(micro_batches)
            saved = SavedBytes()
            features, grads, held = _shared(micro_batches, dist.group.WORLD, recompute, saved)
            if recompute and saved.per_call:
                # "none" saves one micro-batch's pixel rows [P, C] (the toy linear's input) at a time
                one_micro_batch = max(sum(t * h * w for t, h, w in grids) for grids in step) * CHANNELS * 8
                print(f"rank {rank} recompute: saved per encoder call {saved.per_call} B, one micro-batch "
                      f"{one_micro_batch} B")
                assert max(saved.per_call) <= one_micro_batch
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want)
            if rank == 0:
                assert len(features) == len(step)
                for got, want in zip(features, expected_features):
                    torch.testing.assert_close(got, want)
                rows = sum(f.shape[0] for f in expected_features)
                assert held >= rows * WIDTH * 8  # at least the gathered features
    finally:
        dist.destroy_process_group()


def test_step_encoding_matches_encoding_each_micro_batch_alone():
    run_workers(_worker, WORLD_SIZE, (free_port(),), 120)


def test_recompute_groups_consecutive_media_within_one_micro_batchs_patches():
    assert _media_groups([16, 8, 16, 4], 24) == [(0, 2), (2, 4)]
    assert _media_groups([30, 4, 4], 24) == [(0, 1), (1, 3)]  # a medium larger than the budget: alone
    assert _media_groups([4, 30], 24) == [(0, 1), (1, 2)]
    assert _media_groups([], 24) == []
