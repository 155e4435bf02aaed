"""Qwen3.5 (megatron-core, TP 1) equals transformers' Qwen3_5ForConditionalGeneration, and with experts
Qwen3_5MoeForConditionalGeneration (routed experts and a gated shared expert), in fp32, every parameter
random (the zero-centred norms, Gated DeltaNet's convolution, decays and gated norm included): logits and
per-token loss on text, one image, two images, a video; a packed (thd) row of three samples gives each
sample's logits as it gives alone, which fails if a linear-attention layer's convolution or recurrent state
crosses a sample boundary (the same row as one sample differs); HF <-> ours round trip of every tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.loader import load_run_config
from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.qwen3_5.hf_mapping import to_hub_style
from loongforge.models.registry import get_family
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.test_qwen3_vl_support import hf_logits, hf_position_ids, make_sample, our_inputs

# Relative to the largest logit: the gated delta rule's fp32 summation order alone moves these logits by
# about 2e-6 of the largest (our chunked form vs our token-by-token form), more than attention's does.
TOLERANCE = 1e-5
CASES = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),
    "video": dict(videos=((3, 4, 6),)),
}


def tiny_model_cfg(moe: bool = False):
    """qwen3.5-tiny (or qwen3.5-moe-tiny: 8 routed experts, top-2, and a gated shared expert in every layer)."""
    model_cfg = load_run_config("qwen3.5-moe-tiny" if moe else "qwen3.5-tiny").model
    model_cfg.layer_backend = "sdpa"
    return model_cfg


def build_hf_model(model_cfg, seed: int = 0):
    """A random fp32 transformers Qwen3.5 (Qwen3.5-MoE with experts): every parameter drawn anew, norms around
    their identity scale."""
    import transformers

    config = transformers.AutoConfig.for_model(**get_family("qwen3_5").config_to_hf(model_cfg, "float32"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") and "language_model" not in name else 0.0
            if name.endswith("linear_attn.norm.weight"):
                centre = 1.0  # the gated norm scales by its weight, the others by 1 + weight
            torch.nn.init.normal_(param, mean=centre, std=0.1 if "norm" in name else 0.05, generator=generator)
    return model


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


def _build(model_cfg, **kwargs):
    from loongforge.models.qwen3_5.model import build_model

    return build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                       device="cpu", **kwargs)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(world, request):
    model_cfg = tiny_model_cfg(moe=request.param == "moe")
    hf_model = build_hf_model(model_cfg)
    model = _build(model_cfg).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model, model


@pytest.mark.parametrize("case", CASES)
def test_logits_and_loss_match_transformers(pair, case):
    model_cfg, hf_model, model = pair
    sample = make_sample(model_cfg, **CASES[case])
    reference = hf_logits(hf_model, sample)  # [1, s, V]
    inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    with torch.no_grad():
        logits = model(**inputs)
        loss = model(**inputs, labels=labels)
    diff = relative(logits, reference)
    kind = "moe" if model_cfg.language.num_experts else "dense"
    print(f"\nqwen3.5 {kind} {case}: logits differ by {diff:.1e} of the largest")
    assert diff <= TOLERANCE
    reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
    assert relative(loss[0], reference_loss) <= TOLERANCE


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def _packed(lengths: list[int]) -> PackedSeqParams:
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def test_packed_row_gives_each_sample_its_own_logits(pair):
    """Three samples in one thd row (an image sample, a video sample, text): each sample's logits equal
    transformers' on it alone; the row run as one sample (the state carried over) does not."""
    model_cfg, hf_model, model = pair
    samples = [make_sample(model_cfg, images=((1, 8, 12),), seed=1),
               make_sample(model_cfg, text_len=7, videos=((2, 4, 6),), seed=2),
               make_sample(model_cfg, text_len=20, seed=3)]
    references = [hf_logits(hf_model, s)[0] for s in samples]
    lengths = [s.input_ids.shape[1] for s in samples]
    inputs = dict(
        input_ids=torch.cat([s.input_ids for s in samples], dim=1),
        position_ids=torch.cat([hf_position_ids(hf_model, s) for s in samples], dim=2),
        pixel_values=samples[0].pixel_values, image_grid_thw=samples[0].image_grid_thw,
        pixel_values_videos=samples[1].pixel_values_videos, video_grid_thw=samples[1].video_grid_thw,
    )
    with torch.no_grad():
        packed = model(**inputs, packed_seq_params=_packed(lengths))[0]
        one_sample = model(**inputs, packed_seq_params=_packed([sum(lengths)]))[0]
    worst = max(relative(got, expected) for got, expected in zip(packed.split(lengths), references))
    leaked = relative(one_sample.split(lengths)[2], references[2])
    print(f"\npacked row vs each sample alone: {worst:.2e}; the row as one sample: {leaked:.2e}")
    assert worst <= TOLERANCE and leaked > 1e-2


def test_weights_round_trip_to_the_hub_key_style(pair):
    """Every HF tensor is read and written back unchanged, in the Hub's style."""
    model_cfg, hf_model, model = pair
    expected = to_hub_style(hf_model.state_dict())
    if model_cfg.language.tie_word_embeddings:
        expected.pop("lm_head.weight")
    written = megatron_to_hf([model.state_dict()], model_cfg)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], expected[key]) for key in expected)
