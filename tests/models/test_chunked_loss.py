"""The chunked LM head and cross-entropy (``training.loss_chunk_tokens``, ``models.decoder.chunked_loss``) equal
the whole logits' in fp32, within 1e-6: the function against megatron-core's (vocabulary padding, a
per-token incoming gradient, chunk edges that do and do not divide the tokens), and whole models against
themselves built with the setting off: loss-masked and unmasked, tied and untied heads, and DeepSeek-V3's
multi-token-prediction head. TP 2 (with and without sequence parallelism) is ``test_tp_parity``'s launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import tensor_parallel

from loongforge.config.schema import ParallelConfig
from loongforge.models.decoder import language_model
from loongforge.models.decoder.chunked_loss import chunked_cross_entropy
from loongforge.models.llm.model import build_model
from tests.models.llm_helpers import text_positions, tiny_llm_cfg

TOLERANCE = 1e-6
LENGTH = 29  # not a multiple of the chunk below: the last chunk is short


def _whole(hidden, weight, labels, true_vocab_size):
    """megatron-core's loss of the whole logits, as ``LanguageModel`` computes it: padding ids at -inf."""
    logits = hidden @ weight.t()  # [n, V]
    logits = logits.masked_fill(torch.arange(weight.shape[0]) >= true_vocab_size, float("-inf"))
    return tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], labels[:, None])[:, 0]


@pytest.mark.parametrize("chunk_tokens", [1, 8, 64])
def test_chunked_cross_entropy_equals_the_whole_logits(megatron_world_of_one, chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    tokens, width, padded, true_vocab = 37, 16, 64, 50  # the last 14 ids padding
    # logits of a trained model's size (std 1, a loss near log V): fp32 rounding alone stays below 1e-6
    hidden = (0.5 * torch.randn(tokens, width, generator=generator)).requires_grad_()
    weight = (0.5 * torch.randn(padded, width, generator=generator)).requires_grad_()
    labels = torch.randint(0, true_vocab, (tokens,), generator=generator)
    incoming = torch.rand(tokens, generator=generator)  # a per-token weight, as a loss mask / token count gives
    figures = []
    for loss_of in (lambda: _whole(hidden, weight, labels, true_vocab),
                    lambda: chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens,
                                                  true_vocab_size=true_vocab)):
        loss = loss_of()
        hidden_grad, weight_grad = torch.autograd.grad((loss * incoming).sum(), (hidden, weight))
        figures.append((loss, hidden_grad, weight_grad))
    differences = [float((ours - theirs).abs().max()) for ours, theirs in zip(*figures)]
    print(f"\nchunk {chunk_tokens}: loss, hidden gradient, weight gradient within {differences}")
    assert max(differences) <= TOLERANCE
    assert figures[1][2][true_vocab:].abs().max() == 0  # padding rows take no gradient


def test_chunk_tokens_must_be_positive():
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        chunked_cross_entropy(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long),
                              chunk_tokens=0, true_vocab_size=8)


def _loss_and_grads(model_cfg, chunk_tokens: int, state, inputs: dict) -> tuple:
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu", loss_chunk_tokens=chunk_tokens).train()
    model.load_state_dict(state)
    loss = model(**inputs)  # [1, s]
    mask = inputs.get("loss_mask", torch.ones_like(loss))
    ((loss * mask).sum() / mask.sum()).backward()  # the step's objective: the mean over loss tokens
    return loss.detach(), {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


def _compare(model_cfg, inputs: dict, observe=lambda: None) -> tuple[float, list]:
    """(the largest difference of the loss and every parameter's gradient, chunks of 4 tokens vs the whole
    logits; ``observe()`` after each of the two runs)."""
    state = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu", init_seed=5).state_dict()
    runs, observed = [], []
    for chunk_tokens in (0, 4):
        runs.append(_loss_and_grads(model_cfg, chunk_tokens, state, inputs))
        observed.append(observe())
    (loss, grads), (chunked_loss, chunked_grads) = runs
    assert grads.keys() == chunked_grads.keys() and "language_model.embedding.word_embeddings.weight" in grads
    return max([float((loss - chunked_loss).abs().max())]
               + [float((grads[name] - chunked_grads[name]).abs().max()) for name in grads]), observed


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # an untied head, a tied one; vocabulary 300 padded to 384
@pytest.mark.parametrize("masked", [True, False])
def test_a_model_trains_alike_with_the_loss_in_chunks(megatron_world_of_one, arch, masked):
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, 300, (1, LENGTH), generator=generator),
              "position_ids": text_positions(LENGTH), "labels": torch.randint(0, 300, (1, LENGTH), generator=generator)}
    if masked:
        inputs["loss_mask"] = (torch.rand(1, LENGTH, generator=generator) < 0.6).float()
    difference, _ = _compare(tiny_llm_cfg(arch), inputs)
    print(f"\n{arch} {'loss-masked' if masked else 'every position'}: loss and gradients within {difference:.1e}")
    assert difference <= TOLERANCE


def test_multi_token_prediction_trains_alike_with_the_loss_in_chunks(megatron_world_of_one, monkeypatch):
    """Every head megatron's MTP code runs (the decoder's, the MTP layer's) is chunked: the same loss, the same
    tracked MTP loss and the same gradients (the MTP layer's reach it only through its own head)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model_cfg = tiny_llm_cfg("deepseek_v3")
    model_cfg = dataclasses.replace(model_cfg, language=dataclasses.replace(model_cfg.language, mtp_num_layers=1))
    generator = torch.Generator().manual_seed(2)
    mask = torch.ones(1, LENGTH)
    mask[0, :7] = 0
    inputs = {"input_ids": torch.randint(0, 300, (1, LENGTH), generator=generator),
              "position_ids": text_positions(LENGTH), "loss_mask": mask,
              "labels": torch.randint(0, 300, (1, LENGTH), generator=generator)}

    def tracked_mtp_loss() -> float:
        value = float(MTPLossLoggingHelper.tracker["values"][0])
        MTPLossLoggingHelper.tracker.clear()
        return value

    heads = []  # the head inputs the chunked loss receives: [s * b, h] each
    monkeypatch.setattr(language_model, "chunked_cross_entropy",
                        lambda hidden, *args, **kwargs: heads.append(hidden.shape) or chunked_cross_entropy(
                            hidden, *args, **kwargs))
    MTPLossLoggingHelper.tracker.clear()
    difference, (whole, chunked) = _compare(model_cfg, inputs, tracked_mtp_loss)
    assert heads == [(LENGTH, 64)] * 2  # the MTP layer's head, then the decoder's, every position
    print(f"\nDeepSeek-V3 with an MTP layer: loss and gradients within {difference:.1e}; MTP loss {chunked:.6f}, "
          f"{abs(chunked - whole):.1e} from the whole logits'")
    assert difference <= TOLERANCE and abs(chunked - whole) <= TOLERANCE


def test_a_frozen_head_passes_the_hidden_gradient_alone():
    """training.freeze_language: the head's weight takes no gradient; the hidden states' is unchanged."""
    generator = torch.Generator().manual_seed(4)
    hidden = (0.5 * torch.randn(20, 8, generator=generator)).requires_grad_()
    weight = 0.5 * torch.randn(30, 8, generator=generator)
    labels = torch.randint(0, 30, (20,), generator=generator)
    grads = []
    for trained in (True, False):
        head = weight.clone().requires_grad_(trained)
        chunked_cross_entropy(hidden, head, labels, chunk_tokens=6, true_vocab_size=30).sum().backward()
        grads.append(hidden.grad)
        hidden.grad = None
        assert (head.grad is not None) == trained
    assert torch.equal(*grads)
