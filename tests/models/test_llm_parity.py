"""The text-only family (TextModel, megatron-core, TP=1) equals transformers' Qwen2ForCausalLM,
Qwen3ForCausalLM, LlamaForCausalLM and Qwen3MoeForCausalLM (both routers: top-k renormalised or not):
logits, per-token loss, a packed row of several samples (routing is per token, so packing changes no
expert choice), and the answer-masked loss the training step computes (transformers' MoE aux loss
left out: ``output_router_logits`` is off, as in its default)."""

import pytest
import torch
import torch.nn.functional as F

from tests.models.llm_helpers import ARCHITECTURES_WITH_MOE, build_pair, text_positions

TOLERANCE = 1e-5


@pytest.fixture(params=list(ARCHITECTURES_WITH_MOE))
def pair(request, megatron_world_of_one):
    return (request.param, *build_pair(request.param))


def _ids(length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def test_logits_and_loss_match_transformers(pair):
    arch, model_cfg, hf_model, model = pair
    input_ids = _ids(40, 0, model_cfg.language.vocab_size)
    labels = _ids(40, 1, model_cfg.language.vocab_size)
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits  # [1, s, V]
        logits = model(input_ids=input_ids, position_ids=text_positions(40))
        loss = model(input_ids=input_ids, position_ids=text_positions(40), labels=labels)
    vocab = model_cfg.language.vocab_size
    assert logits.shape[:2] == reference.shape[:2] and logits.shape[2] == 384, arch  # padded to 3 x 128
    print(f"{arch}: max |logit diff| {(logits[..., :vocab] - reference).abs().max().item():.2e}")
    assert (logits[..., :vocab] - reference).abs().max() <= TOLERANCE, arch
    assert (loss[0] - F.cross_entropy(reference[0], labels[0], reduction="none")).abs().max() <= TOLERANCE, arch


def test_packed_row_equals_samples_run_alone(pair):
    """Positions restart at every packed segment, as each sample alone starts at 0."""
    from megatron.core.packed_seq_params import PackedSeqParams

    arch, model_cfg, hf_model, model = pair
    lengths = [9, 17, 4]  # two samples and a padding segment
    samples = [_ids(n, 10 + i, model_cfg.language.vocab_size) for i, n in enumerate(lengths)]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    positions = torch.cat([text_positions(n) for n in lengths], dim=2)
    with torch.no_grad():
        logits = model(input_ids=torch.cat(samples, dim=1), position_ids=positions, packed_seq_params=packed)
        for sample, start in zip(samples[:2], cu_seqlens[:2].tolist()):
            reference = hf_model(input_ids=sample).logits[0]
            ours = logits[0, start:start + sample.shape[1], :model_cfg.language.vocab_size]
            assert (ours - reference).abs().max() <= TOLERANCE, arch


def test_answer_masked_loss_matches_transformers_loss(pair):
    """The training step's loss (LM head on answer tokens only) against transformers' mean loss."""
    from loongforge.train.step import make_forward_step

    arch, model_cfg, hf_model, model = pair
    length = 24
    input_ids = _ids(length, 3, model_cfg.language.vocab_size)
    hf_labels = torch.full_like(input_ids, -100)
    hf_labels[0, 15:] = input_ids[0, 15:]  # the answer: the last 9 tokens
    with torch.no_grad():
        reference = float(hf_model(input_ids=input_ids, labels=hf_labels).loss)
    following = torch.cat([hf_labels[0, 1:], torch.tensor([-100])])
    batch = {
        "input_ids": input_ids,
        "labels": torch.where(following != -100, following, 0)[None],
        "loss_mask": (following != -100).float()[None],
        "position_ids": text_positions(length),
        "cu_seqlens": torch.tensor([0, length], dtype=torch.int32),
    }
    with torch.no_grad():
        output, loss_func = make_forward_step(torch.device("cpu"))(iter([batch]), model)
        loss_sum, num_tokens, _ = loss_func(output)
    assert int(num_tokens) == 9
    assert (output[batch["loss_mask"] == 0] == 0).all()
    assert abs(float(loss_sum) / int(num_tokens) - reference) <= TOLERANCE, arch


def test_media_are_refused(pair):
    _, model_cfg, _, model = pair
    with pytest.raises(ValueError, match="a text-only model takes no images or videos"):
        model(input_ids=_ids(4, 0, 10), position_ids=text_positions(4), pixel_values=torch.zeros(4, 8))
