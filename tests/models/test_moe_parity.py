"""Qwen3-MoE on megatron-core's MoE layer (router, all-gather dispatcher, SequentialMLP experts)
equals transformers' Qwen3MoeForCausalLM at TP 1, fp32, every parameter random: logits and
per-token loss, a packed row, the answer-masked loss; and both routers (top-k renormalised, and
not: ``norm_topk_prob``)."""

import pytest
import torch
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf_weights import load_hf_state_dict
from loongforge.models.llm.model import build_model
from tests.models.llm_helpers import MOE_ARCHITECTURES, build_hf_llm, text_positions, tiny_llm_cfg

TOLERANCE = 1e-5


@pytest.fixture(params=list(MOE_ARCHITECTURES))
def pair(request, megatron_world_of_one):
    arch = request.param
    model_cfg = tiny_llm_cfg(arch)
    hf_model = build_hf_llm(arch)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu").eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return arch, model_cfg, hf_model, model


def _ids(length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def test_model_is_megatron_moe(pair):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    _, model_cfg, _, model = pair
    for layer in model.language_model.decoder.layers:
        assert isinstance(layer.mlp, MoELayer) and isinstance(layer.mlp.experts, SequentialMLP)
        assert isinstance(layer.mlp.token_dispatcher, MoEAllGatherTokenDispatcher)
        assert layer.mlp.router.topk == model_cfg.language.moe_router_topk == 2
        assert len(layer.mlp.experts.local_experts) == model_cfg.language.num_experts == 4


def test_logits_and_loss_match_transformers(pair):
    arch, model_cfg, hf_model, model = pair
    input_ids = _ids(40, 0, model_cfg.language.vocab_size)
    labels = _ids(40, 1, model_cfg.language.vocab_size)
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits  # [1, s, V]
        logits = model(input_ids=input_ids, position_ids=text_positions(40))
        loss = model(input_ids=input_ids, position_ids=text_positions(40), labels=labels)
    vocab = model_cfg.language.vocab_size
    assert (logits[..., :vocab] - reference).abs().max() <= TOLERANCE, arch
    assert (loss[0] - F.cross_entropy(reference[0], labels[0], reduction="none")).abs().max() <= TOLERANCE, arch


def test_packed_row_equals_samples_run_alone(pair):
    """Routing is per token, so packing changes no expert choice; positions restart per segment."""
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
    """The training step's loss (LM head on answer tokens only) against transformers' mean loss
    (its aux loss left out: ``output_router_logits`` is off, as in transformers' default)."""
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
    assert abs(float(loss_sum) / int(num_tokens) - reference) <= TOLERANCE, arch


def test_weights_round_trip_through_megatron_bit_exact(pair, tmp_path):
    """transformers 5's fused experts -> megatron's per-expert linears -> the Hub layout (one tensor
    per expert), which transformers loads back into the very same fused tensors."""
    from transformers import AutoModelForCausalLM

    from loongforge.models.hf_weights import megatron_to_hf
    from loongforge.models.registry import get_family

    arch, model_cfg, hf_model, model = pair
    hub = megatron_to_hf([model.state_dict()], model_cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in hub and "model.layers.0.mlp.gate.weight" in hub
    assert {k: tuple(v.shape) for k, v in hub.items()} == get_family("llm").hf_shapes(model_cfg)
    hf_model.save_pretrained(tmp_path)  # the config; the weights are replaced by ours below
    from safetensors.torch import save_file

    for stale in tmp_path.glob("*.safetensors*"):
        stale.unlink()
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    original = hf_model.state_dict()
    assert sorted(reloaded) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(reloaded[key], tensor), key
