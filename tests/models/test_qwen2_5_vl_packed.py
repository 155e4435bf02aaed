"""A packed (thd) row of several samples equals running each sample alone."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.qwen2_5_vl.model import build_model
from tests.models.helpers import (
    build_hf_model,
    cat_media,
    hf_position_ids,
    make_sample,
    our_inputs,
    sample_media,
    tiny_model_cfg,
)

TOLERANCE = 1e-5


def _packed_params(lengths: list[int]) -> PackedSeqParams:
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
    )


@pytest.fixture
def model_and_samples(megatron_world_of_one):
    model_cfg = tiny_model_cfg(tie=True)
    hf_model = build_hf_model(model_cfg)
    model = build_model(
        model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu"
    ).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    samples = [
        make_sample(model_cfg, images=((1, 8, 12),), seed=1),
        make_sample(model_cfg, text_len=20, seed=2),
        make_sample(model_cfg, images=((1, 12, 8), (1, 4, 4)), seed=3),
    ]
    positions = [hf_position_ids(hf_model, s) for s in samples]  # each restarts at 0
    return model, samples, positions


def test_packed_row_equals_samples_alone(model_and_samples):
    model, samples, positions = model_and_samples
    with torch.no_grad():
        alone = [model(**our_inputs(s, p))[0] for s, p in zip(samples, positions)]  # [s_i, V]
        lengths = [s.input_ids.shape[1] for s in samples]
        packed = model(
            input_ids=torch.cat([s.input_ids for s in samples], dim=1),
            position_ids=torch.cat(positions, dim=2),
            packed_seq_params=_packed_params(lengths),
            media=cat_media([sample_media(s) for s in samples]),
        )[0]
    for index, (expected, got) in enumerate(zip(alone, packed.split(lengths))):
        assert (got - expected).abs().max() <= TOLERANCE, f"sample {index}"


def test_cu_seqlens_must_cover_the_row(model_and_samples):
    model, samples, positions = model_and_samples
    sample = samples[1]
    length = sample.input_ids.shape[1]
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        model(**our_inputs(sample, positions[1]), packed_seq_params=_packed_params([length - 3]))
