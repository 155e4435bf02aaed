"""Qwen2_5_VLModel (megatron-core, TP=1) equals transformers' Qwen2_5_VLForConditionalGeneration."""

import pytest
import torch
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from loongforge.models.qwen2_5_vl.hf_mapping import load_hf_state_dict
from loongforge.models.qwen2_5_vl.model import build_model
from tests.models.helpers import (
    build_hf_model,
    hf_logits,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-4

CASES = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),  # 2 windows, one partial
    "two_images": dict(images=((1, 8, 12), (1, 20, 16))),  # different sizes, partial windows
    "video": dict(videos=((2, 8, 8),)),  # 2 temporal patches
    "image_and_video": dict(images=((1, 8, 12),), videos=((2, 8, 8),)),
}


def _build_pair(tie: bool):
    model_cfg = tiny_model_cfg(tie=tie)
    hf_model = build_hf_model(model_cfg)
    model = build_model(
        model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu"
    ).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model, model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_and_loss_match_transformers(megatron_world_of_one, tie):
    model_cfg, hf_model, model = _build_pair(tie)
    for name, layout in CASES.items():
        sample = make_sample(model_cfg, **layout)
        reference = hf_logits(hf_model, sample)  # [1, s, V]
        inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
        labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
        with torch.no_grad():
            logits = model(**inputs)
            loss = model(**inputs, labels=labels)
        assert logits.shape == reference.shape, name
        assert (logits - reference).abs().max() <= TOLERANCE, name
        reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
        assert loss.dtype == torch.float32 and loss.shape == labels.shape, name
        assert (loss[0] - reference_loss).abs().max() <= TOLERANCE, name


def test_tied_model_has_no_separate_output_weight(megatron_world_of_one):
    _, _, model = _build_pair(tie=True)
    assert model.language_model.output_layer.weight is None
    assert model.shared_embedding_or_output_weight() is model.language_model.embedding.word_embeddings.weight


def test_image_token_count_mismatch_is_a_loud_error(megatron_world_of_one):
    model_cfg, hf_model, model = _build_pair(tie=True)
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
    inputs["image_grid_thw"] = torch.tensor([[1, 8, 8]])  # 16 merged patches, 24 placeholders
    inputs["pixel_values"] = inputs["pixel_values"][:64]
    with pytest.raises(ValueError, match=r"24 image tokens .* 16 merged patches"):
        model(**inputs)


def test_gradients_flow_into_both_towers(megatron_world_of_one):
    model_cfg, hf_model, model = _build_pair(tie=True)
    model.train()
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    model(**our_inputs(sample, hf_position_ids(hf_model, sample)), labels=labels).mean().backward()
    for part in (model.vision_model.patch_embed, model.projector, model.language_model.decoder):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters())


def test_padded_vocabulary_does_not_change_the_loss(megatron_world_of_one):
    model_cfg = tiny_model_cfg(tie=False)
    model_cfg.language.vocab_size = 151700  # not a multiple of 128: megatron pads to 151808
    hf_model = build_hf_model(model_cfg)
    model = build_model(
        model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu"
    ).eval()
    load_hf_state_dict(model, hf_model.state_dict())
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    reference = hf_logits(hf_model, sample)
    with torch.no_grad():
        logits, loss = model(**inputs), model(**inputs, labels=labels)
    assert logits.shape[-1] == 151808
    assert (logits[..., :151700] - reference).abs().max() <= TOLERANCE
    assert (loss[0] - F.cross_entropy(reference[0], labels[0], reduction="none")).abs().max() <= TOLERANCE


def test_runs_under_megatron_schedule(megatron_world_of_one):
    """megatron's forward/backward schedule finds what it needs on the model (config, model_type)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from loongforge.parallel import mcore_patches

    mcore_patches.apply_cpu()  # the schedule itself has CUDA-only call sites
    model_cfg, hf_model, model = _build_pair(tie=True)
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    labels = torch.randint(0, model_cfg.language.vocab_size, sample.input_ids.shape)
    batch = dict(our_inputs(sample, hf_position_ids(hf_model, sample)), labels=labels)

    def forward_step(data_iterator, model):
        loss = model(**next(data_iterator))
        return loss, lambda output: (output.sum(), {"loss_sum": output.sum().detach()})

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=sample.input_ids.shape[1], micro_batch_size=1, forward_only=False,
    )
    with torch.no_grad():
        expected = model(**batch).sum()
    assert torch.allclose(reports[0]["loss_sum"], expected)
    assert model.projector.mlp.linear_fc1.weight.grad is not None
