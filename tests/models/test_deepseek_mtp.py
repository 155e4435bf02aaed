"""DeepSeek-V3's multi-token prediction (``model.language.mtp_num_layers``) against a reference assembled from
transformers' own DeepSeek-V3 modules (transformers' class has no MTP layer): the next token's embedding and
the decoder's final hidden state, each RMS-normed, concatenated [embedding, hidden] and projected, one
DeepSeek-V3 decoder layer (sparse) at the same positions, the head's norm and the shared head; its loss
predicts the token two ahead. The model's logits are the decoder's alone; the MTP loss and its gradient
(at its coefficient) equal the reference's; the weights read from and written back to DeepSeek-V3's
checkpoint layout (the layer after the last decoder layer, with its copies of the embedding and the head)
are unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
from loongforge.models.llm.model import build_model
from loongforge.models.registry import get_family
from tests.models.llm_helpers import build_hf_llm, text_positions, tiny_llm_cfg

ARCH, COEFF, LENGTH = "deepseek_v3", 0.3, 40
TOLERANCE = 1e-5


@pytest.fixture
def case(megatron_world_of_one):
    """(our model with one MTP layer, transformers' 3-layer main model, the MTP parts, the HF state)."""
    hf = build_hf_llm(ARCH, num_hidden_layers=4)  # layer 3: the MTP layer's decoder layer (sparse)
    generator = torch.Generator().manual_seed(11)
    h = hf.config.hidden_size
    parts = {"enorm": 1 + 0.1 * torch.randn(h, generator=generator), "hnorm": 1 + 0.1 * torch.randn(h, generator=generator),
             "eh_proj": 0.05 * torch.randn(h, 2 * h, generator=generator),
             "head_norm": 1 + 0.1 * torch.randn(h, generator=generator), "layer": hf.model.layers[3]}
    state = dict(hf.state_dict())
    state.update({"model.layers.3.enorm.weight": parts["enorm"], "model.layers.3.hnorm.weight": parts["hnorm"],
                  "model.layers.3.eh_proj.weight": parts["eh_proj"],
                  "model.layers.3.shared_head.norm.weight": parts["head_norm"],
                  "model.layers.3.embed_tokens.weight": state["model.embed_tokens.weight"],
                  "model.layers.3.shared_head.head.weight": state["lm_head.weight"]})
    hf.model.layers = hf.model.layers[:3]
    hf.config.num_hidden_layers = 3
    model_cfg = tiny_llm_cfg(ARCH)
    model_cfg = dataclasses.replace(model_cfg, language=dataclasses.replace(
        model_cfg.language, mtp_num_layers=1, mtp_loss_coeff=COEFF))
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu")
    load_hf_state_dict(model, state)
    return model_cfg, model, hf, parts, state


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(hf, parts, ids, labels, mask):
    """Main per-token loss [s] and the MTP per-token loss [s] with its mask (the last position has no token two
    ahead), from transformers' modules."""
    out = hf.model(input_ids=ids)
    hidden = out.last_hidden_state  # [1, s, h], after the final norm
    logits = hf.lm_head(hidden)[0]
    main = F.cross_entropy(logits, labels[0], reduction="none")
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    embedded = _rms(hf.model.embed_tokens(next_ids), parts["enorm"])
    x = torch.cat([embedded, _rms(hidden, parts["hnorm"])], dim=-1) @ parts["eh_proj"].t()
    positions = torch.arange(ids.shape[1])[None]
    rotary = hf.model.rotary_emb(x, positions)
    causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    x = parts["layer"](x, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
    x = x[0] if isinstance(x, tuple) else x
    mtp_logits = hf.lm_head(_rms(x, parts["head_norm"]))[0]
    next_labels = torch.cat([labels[0, 1:], labels[0, :1] * 0])
    next_mask = torch.cat([mask[0, 1:], mask[0, :1] * 0])
    return main, F.cross_entropy(mtp_logits, next_labels, reduction="none"), next_mask


def test_mtp_loss_and_gradient_equal_the_reference(case):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model_cfg, model, hf, parts, _ = case
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 300, (1, LENGTH), generator=generator)
    labels = torch.randint(0, 300, (1, LENGTH), generator=generator)
    mask = torch.ones(1, LENGTH)
    mask[0, :10] = 0  # a prompt without loss
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, position_ids=text_positions(LENGTH))[..., :300]
        reference_logits = hf(input_ids=ids).logits
    assert (logits - reference_logits).abs().max() <= TOLERANCE  # the decoder's head alone
    MTPLossLoggingHelper.tracker.clear()
    model.train()
    loss = model(input_ids=ids, position_ids=text_positions(LENGTH), labels=labels, loss_mask=mask)  # [1, s]
    (loss * mask).sum().backward()
    tracked = float(MTPLossLoggingHelper.tracker["values"][0])
    main, mtp, mtp_mask = _reference(hf, parts, ids, labels, mask)
    expected = float((mtp * mtp_mask).sum() / mtp_mask.sum())
    print(f"\nMTP loss {tracked:.6f}, reference {expected:.6f}; main loss {float((loss * mask).sum()):.4f}")
    assert abs(tracked - expected) <= 1e-5 * expected
    assert (loss[0] * mask[0] - main * mask[0]).abs().max() <= TOLERANCE
    # The gradient of the objective main + coeff x mean MTP loss, at eh_proj (the MTP's alone).
    reference_eh = torch.nn.Parameter(parts["eh_proj"].clone())
    parts["eh_proj"] = reference_eh
    main, mtp, mtp_mask = _reference(hf, parts, ids, labels, mask)
    ((main * mask[0]).sum() + COEFF * (mtp * mtp_mask).sum() / mtp_mask.sum()).backward()
    ours = model.language_model.mtp.layers[0].eh_proj.weight.grad
    relative = float((ours - reference_eh.grad).abs().max() / reference_eh.grad.abs().max())
    print(f"eh_proj gradient vs reference: {relative:.1e} of the largest")
    assert relative <= 1e-5


def test_the_mtp_layer_round_trips_through_deepseeks_checkpoint_layout(case):
    model_cfg, model, _, _, state = case
    hub = megatron_to_hf([model.state_dict()], model_cfg)
    expected = get_family("llm").to_hub_style(state)
    assert sorted(hub) == sorted(expected)
    assert {k: tuple(v.shape) for k, v in hub.items()} == get_family("llm").hf_shapes(model_cfg)
    different = [key for key in expected if not torch.equal(hub[key], expected[key])]
    assert not different, different[:5]
    assert get_family("llm").config_to_hf(model_cfg)["num_nextn_predict_layers"] == 1
