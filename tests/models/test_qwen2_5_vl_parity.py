"""Qwen2_5_VLModel (megatron-core, TP=1) equals transformers' Qwen2_5_VLForConditionalGeneration:
logits, per-token loss, and the answer-masked loss of a packed row as the training step computes it."""

import pytest
import torch
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.qwen2_5_vl.model import build_model
from tests.models.helpers import (
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


def _answer_labels(sample, answer: list[range]) -> torch.Tensor:
    """transformers' labels [1, s]: the input ids on answer positions, -100 (ignored) elsewhere."""
    labels = torch.full_like(sample.input_ids, -100)
    for span in answer:
        labels[0, span] = sample.input_ids[0, span]
    return labels


def _shifted(hf_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The data pipeline's form of the same targets (data.collate): labels[t] = the token at t+1
    and loss_mask[t] = 1 where that token is an answer token; 0 at the sample's last position."""
    following = torch.cat([hf_labels[0, 1:], torch.tensor([-100])])
    mask = following != -100
    return torch.where(mask, following, 0), mask.float()


def test_answer_masked_packed_loss_matches_transformers_loss(megatron_world_of_one):
    """The training step's loss: two samples and a padding tail packed in one row, the LM head on
    answer tokens only (``loss_mask``), summed and divided by the loss-token count (train.step);
    against transformers' mean loss over labels != -100, per sample, weighted by its token count."""
    from loongforge.train.step import make_forward_step

    model_cfg, hf_model, model = _build_pair(tie=True)
    samples = [make_sample(model_cfg, images=((1, 8, 12),), seed=1), make_sample(model_cfg, text_len=20, seed=2)]
    # Answers: the closing text (5 tokens) and a span inside the opening text, as in a multi-turn chat.
    answers = [_answer_labels(s, [range(2, 6), range(s.input_ids.shape[1] - 5, s.input_ids.shape[1])])
               for s in samples]
    hf_sums, hf_counts = [], []
    for sample, labels in zip(samples, answers):
        with torch.no_grad():
            hf_loss = hf_model(input_ids=sample.input_ids, position_ids=hf_position_ids(hf_model, sample),
                               pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
                               labels=labels).loss
        count = int((labels[0, 1:] != -100).sum())  # transformers shifts: token t+1 from position t
        assert count == 9  # the 4 + 5 answer tokens
        hf_sums.append(float(hf_loss) * count)
        hf_counts.append(count)
    pad = 3
    targets = [_shifted(labels) for labels in answers]
    lengths = [s.input_ids.shape[1] for s in samples] + [pad]
    batch = {
        "input_ids": torch.cat([s.input_ids for s in samples] + [torch.zeros(1, pad, dtype=torch.long)], dim=1),
        "labels": torch.cat([t[0] for t in targets] + [torch.zeros(pad, dtype=torch.long)])[None],
        "loss_mask": torch.cat([t[1] for t in targets] + [torch.zeros(pad)])[None],
        "position_ids": torch.cat([hf_position_ids(hf_model, s) for s in samples]
                                  + [torch.arange(pad).expand(3, 1, pad)], dim=2),
        "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        "pixel_values": samples[0].pixel_values,
        "image_grid_thw": samples[0].image_grid_thw,
    }
    with torch.no_grad():
        output, loss_func = make_forward_step(torch.device("cpu"))(iter([batch]), model)
        loss_sum, num_tokens, _ = loss_func(output)
    assert int(num_tokens) == sum(hf_counts)
    assert (output[batch["loss_mask"] == 0] == 0).all()  # the head ran on answer tokens only
    reference = sum(hf_sums) / sum(hf_counts)
    assert abs(float(loss_sum) / int(num_tokens) - reference) <= TOLERANCE, (float(loss_sum) / int(num_tokens), reference)


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
