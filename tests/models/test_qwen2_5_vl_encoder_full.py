"""``StepEncoding`` (``parallel.encoder_dp=full``) on three gloo ranks with a toy encoder: each
micro-batch's slice of the step's features equals encoding it alone, a text-only micro-batch takes
an empty turn, a rank that encodes nothing still takes part, and the encoder gradients every rank
gets back (summed over the group) equal one rank encoding everything and running the backward."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from loongforge.models.qwen2_5_vl.encoder_full import StepEncoding
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


def _shared(micro_batches, group) -> tuple[list, list, int]:
    rank = dist.get_rank(group)
    tower = _seeded_linear()
    encoding = StepEncoding(group, grad_source=0, receives=rank == 0, merge_unit=MERGE_UNIT,
                            width=WIDTH, dtype=torch.float64, vision_cost=VisionCost)
    held = encoding.begin(lambda p, g: _encode(tower, p, g), micro_batches, torch.device("cpu"))
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
    return features, grads, held


def _worker(rank: int, port: int) -> None:
    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        for step in (STEP, [[(1, 2, 2)], []], [[], []]):  # rank 2 (then all) encode nothing
            micro_batches = [_micro_batch(grids, seed) for seed, grids in enumerate(step)]
            expected_features, expected_grads = _reference(micro_batches)
            features, grads, held = _shared(micro_batches, dist.group.WORLD)
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
