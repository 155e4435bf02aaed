"""Qwen2.5-VL at CP 2 equals transformers on a packed row: each CP rank's logits at the tokens it
holds are those of transformers run on each sample alone. The row's second sample holds an image and a
video (M-RoPE positions that are not 0, 1, 2, ...) and starts mid-row, so rank 1's first tokens are the
middle of the first sample and its image tokens sit in chunks far from the sample's start: positions
computed after the split, or over the packed row instead of per sample, give other logits (the test
shows how far: positions restarted at each CP chunk, as a rank computing them on its own tokens would
have them, miss by more than 1e-2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.config.schema import ParallelConfig
from loongforge.data.packing import padded_length
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.qwen2_5_vl.model import build_model
from loongforge.parallel.context_parallel import local_token_index
from loongforge.train.step import make_forward_step
from tests.models.helpers import (
    build_hf_model,
    destroy_megatron,
    free_port,
    hf_logits,
    hf_position_ids,
    init_megatron,
    limit_threads,
    make_sample,
    run_workers,
    sample_media,
    tiny_model_cfg,
)

CP = 2
TOLERANCE = 1e-5


def _packed_row(model_cfg, hf_model) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(micro-batch of two samples padded to 2 x CP each, reference logits [T, V] with NaN on padding,
    the positions restarted at every CP chunk of every sample [3, 1, T])."""
    samples = [make_sample(model_cfg, text_len=21, seed=1),
               make_sample(model_cfg, images=((1, 8, 12),), videos=((2, 8, 8),), seed=2)]
    ids, positions, restarted, reference, lengths = [], [], [], [], []
    for sample in samples:
        length = sample.input_ids.shape[1]
        pad = padded_length(length, 2 * CP) - length
        sample_positions = hf_position_ids(hf_model, sample)  # [3, 1, L]
        tail = sample_positions[:, :, -1:] + torch.arange(1, pad + 1)  # the collate's padding positions
        ids.append(torch.cat([sample.input_ids, torch.zeros(1, pad, dtype=torch.long)], dim=1))
        positions.append(torch.cat([sample_positions, tail], dim=2))
        chunk = (length + pad) // (2 * CP)
        starts = positions[-1][:, :, ::chunk].repeat_interleave(chunk, dim=2)  # [3, 1, L + pad]
        restarted.append(positions[-1] - starts)
        logits = hf_logits(hf_model, sample)[0]  # [L, V]
        reference.append(torch.cat([logits, torch.full((pad, logits.shape[1]), float("nan"))]))
        lengths.append(length + pad)
    batch = {"input_ids": torch.cat(ids, dim=1), "position_ids": torch.cat(positions, dim=2),
             "labels": torch.zeros(1, sum(lengths), dtype=torch.long), "loss_mask": torch.zeros(1, sum(lengths)),
             "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
             "media": sample_media(samples[1])}
    return batch, torch.cat(reference), torch.cat(restarted, dim=2)


def _worst(model, batch: dict, reference: torch.Tensor, group) -> float:
    """Largest |logit - transformers'| over this rank's real tokens."""
    forward = {key: value for key, value in batch.items() if key not in ("labels", "loss_mask")}
    step = make_forward_step(torch.device("cpu"), group)
    with torch.no_grad():
        logits, _ = step(iter([{**forward, "labels": None, "loss_mask": None}]), model)  # [1, T/CP, V]
    held = reference[local_token_index(batch["cu_seqlens"], CP, group.rank())]  # [T/CP, V]
    real = ~held.isnan().any(-1)
    return float((logits[0][real] - held[real]).abs().max())


def _worker(rank: int, port: int) -> None:
    from megatron.core import parallel_state

    limit_threads()
    init_megatron(rank, CP, port, cp=CP)
    try:
        model_cfg = tiny_model_cfg()
        hf_model = build_hf_model(model_cfg)
        model = build_model(model_cfg, ParallelConfig(context_parallel_size=CP), params_dtype=torch.float32,
                            pre_process=True, post_process=True, device="cpu").eval()
        load_hf_state_dict(model, hf_model.state_dict())
        batch, reference, restarted = _packed_row(model_cfg, hf_model)
        group = parallel_state.get_context_parallel_group()
        worst = _worst(model, batch, reference, group)
        wrong = _worst(model, {**batch, "position_ids": restarted}, reference, group)
        print(f"CP rank {rank}: logits vs transformers per sample {worst:.1e}; with positions restarted at "
              f"each CP chunk {wrong:.1e}")
        assert worst <= TOLERANCE
        assert wrong > 1e-2
        dist.barrier()
    finally:
        destroy_megatron()


def test_cp2_logits_of_a_packed_row_equal_transformers_per_sample():
    run_workers(_worker, CP, (free_port(),), timeout_s=180)
