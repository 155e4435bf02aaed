"""The --sweep design and the features extracted from micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loongforge.balance.cost_model import TERMS
from loongforge.calibrate.sweep import ROW_DESIGNS, SweepSource, image_grids, length_grid
from loongforge.config.loader import load_run_config
from loongforge.profile.features import micro_batch_record, sample_costs


@pytest.fixture(scope="module", params=["qwen2.5vl-tiny", "qwen2.5vl-tiny-small-vocab"])
def cfg(request):
    # The small vocabulary puts the vision tokens at 4105-4109, inside the range text is drawn from.
    return load_run_config(request.param, overrides=["data.seq_len=1024"])


def _costs(cfg, mb):
    return sample_costs(mb)


def test_length_grid_spans_short_to_seq_len():
    grid = length_grid(4096)
    assert grid[0] == 64 and grid[-1] == 4096 and len(grid) == 8


def test_image_grids_respect_max_pixels_and_merge():
    grids = image_grids(50176, 14, 2)  # 224 x 224 px = 16 x 16 patches
    assert max(h * w for h, w in grids) <= 256
    assert all(h % 2 == 0 and w % 2 == 0 for h, w in grids)
    assert (4, 4) in grids and (16, 16) in grids


def test_sweep_rows_follow_the_collate_contract_and_cover_the_design(cfg):
    source = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=8)
    rows = [mb for _ in range(5) for mb in source.next_step()]
    seen_lengths, packed, with_images = set(), 0, 0
    for mb in rows:
        T = mb["input_ids"].shape[1]
        assert T % 8 == 0 and T <= cfg.data.seq_len
        assert mb["labels"].shape == mb["loss_mask"].shape == (1, T)
        assert mb["position_ids"].shape == (3, 1, T)
        assert int(mb["cu_seqlens"][-1]) == T
        assert sum(mb["sample_lengths"]) <= T
        assert 0 < mb["num_loss_tokens"] < sum(mb["sample_lengths"])
        if mb["media"]:
            with_images += 1
            patches = int(mb["media"].images.grids.prod(dim=1).sum())
            assert mb["media"].images.rows.shape == (patches, 1176)
            assert int((mb["input_ids"] == cfg.model.tokens.image_token_id).sum()) == patches // 4
        else:  # no text token is drawn on a vision token's id
            assert not torch.isin(mb["input_ids"], torch.tensor([cfg.model.tokens.image_token_id,
                                                                 cfg.model.tokens.vision_start_token_id])).any()
        packed += len(mb["sample_lengths"]) > 1
        seen_lengths.update(mb["sample_lengths"])
    assert len(rows) == 5 * cfg.training.global_batch_size
    assert packed and with_images and len(rows) - packed
    assert min(seen_lengths) <= 96 and max(seen_lengths) >= cfg.data.seq_len // 2


def test_sweep_is_deterministic_and_split_over_dp_ranks(cfg):
    whole = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=8).next_step()
    halves = [SweepSource(cfg, dp_rank=r, dp_size=2, pad_to_multiple=8).next_step() for r in (0, 1)]
    joined = halves[0] + halves[1]
    assert [mb["sample_ids"] for mb in joined] == [mb["sample_ids"] for mb in whole]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(joined, whole))


def test_features_assign_images_to_their_samples(cfg):
    source = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=8)
    for index in range(40):
        row = source.design.row(index)
        mb = source.micro_batch(index, row)
        costs = _costs(cfg, mb)
        patch = cfg.model.vision.patch_size  # the designed sizes are whole patches: smart-resize keeps them
        assert [list(c.patches) for c in costs] == [[(h // patch) * (w // patch) for h, w in sizes] for _, sizes in row]
        record = micro_batch_record(mb, costs)
        assert record["features"]["sum_L"] == sum(mb["sample_lengths"])
        assert record["features"]["N"] == len(row)
        assert record["features"]["n_img"] == sum(len(g) for _, g in row)
        assert record["features"]["n_loss"] == mb["num_loss_tokens"] == sum(c.loss_tokens for c in costs)
        assert list(record["features"]) == list(TERMS)


def test_answer_shares_vary_so_the_loss_term_is_identifiable(cfg):
    # With one fixed share, n_loss would be a multiple of sum_L and could not be fitted apart.
    source = SweepSource(cfg, dp_rank=0, dp_size=1, pad_to_multiple=8, answer_share=0.4)
    shares = []
    for index in range(30):
        mb = source.micro_batch(index, source.design.row(index))
        shares += [c.loss_tokens / c.tokens for c in _costs(cfg, mb) if c.tokens >= 256]
    assert min(shares) < 0.25 and max(shares) > 0.55
    assert 0.3 < float(np.mean(shares)) < 0.5


def test_row_designs_cycle():
    assert len(ROW_DESIGNS) == 5
