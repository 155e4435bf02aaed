"""Qwen3-MoE is built from megatron-core's MoE layer (router, all-to-all dispatcher, SequentialMLP
experts), and its experts round-trip between transformers 5's fused tensors and the Hub layout.
Logits, packed rows and the answer-masked loss against Qwen3MoeForCausalLM (both routers) are
test_llm_parity.py's."""

import pytest
import torch

from tests.models.llm_helpers import MOE_ARCHITECTURES, build_pair


@pytest.fixture(params=list(MOE_ARCHITECTURES))
def pair(request, megatron_world_of_one):
    return (request.param, *build_pair(request.param))


def test_model_is_megatron_moe(pair):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _, model_cfg, _, model = pair
    for layer in model.language_model.decoder.layers:
        assert isinstance(layer.mlp, MoELayer) and isinstance(layer.mlp.experts, SequentialMLP)
        assert isinstance(layer.mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
        assert layer.mlp.router.topk == model_cfg.language.moe_router_topk == 2
        assert len(layer.mlp.experts.local_experts) == model_cfg.language.num_experts == 4


def test_weights_round_trip_through_megatron_bit_exact(pair, tmp_path):
    """transformers 5's fused experts -> megatron's per-expert linears -> the Hub layout (one tensor
    per expert), which transformers loads back into the very same fused tensors."""
    from transformers import AutoModelForCausalLM

    from loongforge.models.hf.weights import megatron_to_hf
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
