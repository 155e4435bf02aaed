"""Qwen3VLModel (megatron-core, TP=1) equals transformers' Qwen3VLForConditionalGeneration, and with
routed experts Qwen3VLMoeForConditionalGeneration, in fp32: logits and per-token loss on text, images,
a video and both; the loss-masked head; a packed (thd) row of two samples against separate
transformers runs; DeepStack under activation recompute."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.qwen3_vl.model import build_model
from tests.models.helpers import destroy_megatron, free_port, init_megatron
from tests.models.test_qwen3_vl_support import (
    TINY_VISION,
    build_hf_model,
    hf_logits,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-5

CASES = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),  # position grid 6x6 resampled up to 8x12
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),  # different sizes; 6x4 resamples down
    "video": dict(videos=((3, 4, 6),)),  # 3 frames, each after its own timestamp
    "image_and_video": dict(images=((1, 6, 4),), videos=((2, 4, 6),)),
}


@pytest.fixture(scope="module")
def world():
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()


def _build(model_cfg, **kwargs):
    return build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                       device="cpu", vision=TINY_VISION, **kwargs)


# Qwen3-VL with untied and tied embeddings, and Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration).
VARIANTS = {"untied": dict(), "tied": dict(tie=True), "moe": dict(experts=True)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(world, request):
    model_cfg = tiny_model_cfg(**VARIANTS[request.param])
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
    assert logits.shape == reference.shape
    diff = float((logits - reference).abs().max())
    print(f"{'moe' if model_cfg.language.num_experts else 'dense'} {case}: max abs logits diff {diff:.2e}")
    assert diff <= TOLERANCE
    reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert (loss[0] - reference_loss).abs().max() <= TOLERANCE


def test_loss_masked_head_matches_cross_entropy_of_transformers_logits(pair):
    model_cfg, hf_model, model = pair
    sample = make_sample(model_cfg, **CASES["image_and_video"], seed=4)
    reference = hf_logits(hf_model, sample)[0]
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    loss_mask = torch.zeros(sample.input_ids.shape)
    loss_mask[0, -9:] = 1  # the closing text, as an answer
    loss_mask[0, 3:6] = 1
    with torch.no_grad():
        loss = model(**our_inputs(sample, hf_position_ids(hf_model, sample)), labels=labels, loss_mask=loss_mask)
    picked = loss_mask[0].bool()
    assert (loss[0, ~picked] == 0).all()  # the head ran on masked positions only
    expected = F.cross_entropy(reference[picked], labels[0, picked], reduction="none")
    assert (loss[0, picked] - expected).abs().max() <= TOLERANCE


def _packed_params(lengths: list[int]) -> PackedSeqParams:
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def test_packed_row_of_two_samples_matches_separate_transformers_runs(pair):
    """An image sample and a video sample in one thd row: DeepStack and M-RoPE per token, attention
    per sample; logits and the loss-masked loss equal two separate transformers runs."""
    model_cfg, hf_model, model = pair
    samples = [make_sample(model_cfg, images=((1, 8, 12), (1, 6, 4)), seed=1),
               make_sample(model_cfg, text_len=7, videos=((2, 4, 6),), seed=2)]
    references = [hf_logits(hf_model, s)[0] for s in samples]
    lengths = [s.input_ids.shape[1] for s in samples]
    input_ids = torch.cat([s.input_ids for s in samples], dim=1)
    labels = torch.randint(0, model_cfg.language.vocab_size, input_ids.shape)
    loss_mask = (torch.rand(input_ids.shape) < 0.5).float()
    inputs = dict(
        input_ids=input_ids,
        position_ids=torch.cat([hf_position_ids(hf_model, s) for s in samples], dim=2),
        packed_seq_params=_packed_params(lengths),
        pixel_values=samples[0].pixel_values, image_grid_thw=samples[0].image_grid_thw,
        pixel_values_videos=samples[1].pixel_values_videos, video_grid_thw=samples[1].video_grid_thw,
    )
    with torch.no_grad():
        logits = model(**inputs)[0]
        loss = model(**inputs, labels=labels, loss_mask=loss_mask)[0]
    for index, (got, expected) in enumerate(zip(logits.split(lengths), references)):
        assert (got - expected).abs().max() <= TOLERANCE, f"sample {index}"
    picked = loss_mask[0].bool()
    expected_loss = F.cross_entropy(torch.cat(references), labels[0], reduction="none")
    assert (loss[picked] - expected_loss[picked]).abs().max() <= TOLERANCE
    assert (loss[~picked] == 0).all()


def test_deepstack_under_activation_recompute(world):
    """With full recompute the DeepStack features are an input of each checkpoint: the same loss
    and the same gradients, in the vision tower and the DeepStack mergers too."""
    model_cfg = tiny_model_cfg()
    hf_state = build_hf_model(model_cfg).state_dict()
    sample = make_sample(model_cfg, **CASES["image_and_video"])
    from loongforge.models.qwen3_vl.rope_index import position_ids_for

    position_ids = position_ids_for(model_cfg)(sample.input_ids[0], sample.image_grid_thw,
                                               sample.video_grid_thw)[:, None]
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    results = []
    for recompute in (False, True):
        model = _build(model_cfg, recompute_activations=recompute).train()
        assert model.language_model.config.recompute_granularity == ("full" if recompute else None)
        load_hf_state_dict(model, hf_state)
        loss = model(**our_inputs(sample, position_ids), labels=labels)
        loss.sum().backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, grads), (recomputed_loss, recomputed_grads) = results
    assert torch.equal(loss, recomputed_loss)
    assert grads.keys() == recomputed_grads.keys()
    assert all(grad.abs().sum() > 0 for name, grad in grads.items() if name.startswith("deepstack_projectors."))
    for name, grad in grads.items():
        assert torch.allclose(grad, recomputed_grads[name], rtol=0, atol=1e-6), name


def test_first_pipeline_stage_must_hold_every_deepstack_layer(world):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge.models.vlm.deepstack import check_pipeline

    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=4,
                               pipeline_dtype=torch.float32)
    check_pipeline(config, num_deepstack=1)
    with pytest.raises(ValueError, match=r"first pipeline stage must hold at least 2 decoder layers.* holds 1"):
        check_pipeline(config, num_deepstack=2)


def test_image_token_count_mismatch_is_a_loud_error(pair):
    model_cfg, hf_model, model = pair
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
    inputs["image_grid_thw"] = torch.tensor([[1, 8, 8]])  # 16 merged patches, 24 placeholders
    inputs["pixel_values"] = inputs["pixel_values"][:64]
    with pytest.raises(ValueError, match=r"24 image tokens .* 16 merged patches"):
        model(**inputs)


def test_weights_round_trip_to_the_hub_key_style(pair):
    """Every HF tensor is read (both key styles) and written back unchanged, in the Hub's style."""
    from loongforge.models.hf.weights import megatron_to_hf
    from loongforge.models.qwen3_vl.hf_mapping import to_hub_style

    model_cfg, hf_model, model = pair
    expected = to_hub_style(hf_model.state_dict())
    if model_cfg.language.tie_word_embeddings:
        expected.pop("lm_head.weight")
    written = megatron_to_hf([model.state_dict()], model_cfg)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[key], expected[key]) for key in expected)
    hub_loaded = _build(model_cfg).eval()
    load_hf_state_dict(hub_loaded, expected)
    assert all(torch.equal(a, b) for a, b in zip(hub_loaded.state_dict().values(), model.state_dict().values())
               if isinstance(a, torch.Tensor))
