"""DeepSeek-V3 and V2 (multi-latent attention, DeepSeekMoE) in the text-only family: the routing that
distinguishes them (V3's expert bias and group-limited top-k), the Hub weight layout both ways, and the
config.json both ways. Logits, packed rows and the answer-masked loss against transformers are
test_parity.py's; TP 2 with and without sequence parallelism is test_tp_parity.py's."""

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from loongforge.models.hf.weights import megatron_to_hf
from loongforge.models.registry import get_family
from tests.models.llm_helpers import DEEPSEEK_ARCHITECTURES, build_pair, text_positions, tiny_hf_config_dict

LENGTH = 48


@pytest.fixture(params=list(DEEPSEEK_ARCHITECTURES))
def pair(request, megatron_world_of_one):
    return (request.param, *build_pair(request.param))


@pytest.fixture
def v3(megatron_world_of_one):
    return build_pair("deepseek_v3")


def _router_inputs(hf_model, layer: int, length: int = LENGTH) -> torch.Tensor:
    """The hidden states [T, h] transformers' router of ``layer`` reads for a random sample."""
    inputs = []
    gate = hf_model.model.layers[layer].mlp.gate
    handle = gate.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
    ids = torch.randint(0, hf_model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_model(input_ids=ids)
    handle.remove()
    return inputs[0].reshape(-1, inputs[0].shape[-1])


def _chosen(router: TopKRouter, hidden: torch.Tensor) -> torch.Tensor:
    """Our router's choice [T, E] (bool) and weights for ``hidden`` [T, h]."""
    with torch.no_grad():
        probs, routing_map = router(hidden[:, None])
    return routing_map.reshape(hidden.shape[0], -1), probs.reshape(hidden.shape[0], -1)


def test_layers_are_dense_then_moe_with_shared_experts(pair):
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    arch, model_cfg, _, model = pair
    layers = model.language_model.decoder.layers
    assert all(isinstance(layer.self_attention, MLASelfAttention) for layer in layers), arch
    assert isinstance(layers[0].mlp, MLP) and not isinstance(layers[0].mlp, MoELayer), arch
    for layer in layers[1:]:
        assert isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts is not None, arch
        assert not layer.mlp.shared_experts.use_shared_expert_gate, arch  # DeepSeek's are ungated
    sparse = layers[1].mlp.router
    assert (sparse.expert_bias is not None) == (arch != "deepseek_v2"), arch  # V3's router (V3.2's too)
    # transformers' latent norms keep eps 1e-6 whatever rms_norm_eps is (V2 here: 1e-5, as Moonlight's).
    assert layers[0].self_attention.linear_kv_up_proj.norm_eps == 1e-6, arch
    assert layers[0].input_layernorm.eps == model_cfg.language.rms_norm_eps, arch


def test_router_equals_transformers_and_the_bias_alone_flips_choices(v3):
    """Layer 1's router on transformers' own router inputs: our experts and weights equal
    DeepseekV3TopkRouter's, with the loaded expert bias and with it zeroed; the bias alone changes some
    token's experts (it enters the choice, never the weights)."""
    model_cfg, hf_model, model = v3
    hidden = _router_inputs(hf_model, layer=1)
    hf_gate, ours = hf_model.model.layers[1].mlp.gate, model.language_model.decoder.layers[1].mlp.router
    choices = {}
    for name, bias in (("loaded", hf_gate.e_score_correction_bias.clone()), ("zero", torch.zeros(8))):
        hf_gate.e_score_correction_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
        with torch.no_grad():
            _, hf_weights, hf_indices = hf_gate(hidden)
        reference = torch.zeros(hidden.shape[0], 8).scatter(1, hf_indices, hf_weights)
        chosen, probs = _chosen(ours, hidden)
        assert torch.equal(chosen, reference > 0), name
        assert (probs - reference).abs().max() <= 1e-6, name
        choices[name] = chosen
    flipped = (choices["loaded"] != choices["zero"]).any(dim=1).sum().item()
    print(f"tokens whose experts the bias alone changes: {flipped} of {hidden.shape[0]}")
    assert flipped >= 1


def test_group_limited_routing_is_active(v3):
    """Every token's 4 experts lie in at most topk_group=2 of the 4 groups, and for some token that
    excludes an expert the plain top-4 of the biased scores would take."""
    model_cfg, hf_model, model = v3
    hidden = _router_inputs(hf_model, layer=2)
    router = model.language_model.decoder.layers[2].mlp.router
    chosen, _ = _chosen(router, hidden)
    groups_used = chosen.reshape(-1, 4, 2).any(dim=2).sum(dim=1)  # [T]: groups of 2 experts each
    assert int(groups_used.max()) <= 2 and int(chosen.sum(dim=1).min()) == 4
    with torch.no_grad():
        scores = torch.sigmoid(hidden.float() @ router.weight.t().float()) + router.expert_bias
    plain = torch.zeros_like(chosen).scatter(1, scores.topk(4, dim=1).indices, True)
    differing = (plain != chosen).any(dim=1).sum().item()
    print(f"tokens the group limit reroutes: {differing} of {hidden.shape[0]}")
    assert differing >= 1


def test_weights_round_trip_through_megatron_bit_exact(pair, tmp_path):
    """Hub layout -> megatron -> Hub layout, the expert bias and the dense first layer included, which
    transformers loads back into the very same tensors."""
    arch, model_cfg, hf_model, model = pair
    hub = megatron_to_hf([model.state_dict()], model_cfg)
    assert {k: tuple(v.shape) for k, v in hub.items()} == get_family("llm").hf_shapes(model_cfg), arch
    hf_model.save_pretrained(tmp_path)
    for stale in tmp_path.glob("*.safetensors*"):
        stale.unlink()
    save_file({k: v.contiguous() for k, v in hub.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    original = dict(hf_model.state_dict())
    state = reloaded.state_dict()
    assert sorted(state) == sorted(original), arch
    for key, tensor in original.items():
        assert torch.equal(state[key], tensor), (arch, key)


def test_config_json_round_trip(pair):
    """config.json -> ModelConfig -> config.json keeps every field transformers builds the model from."""
    arch, model_cfg, hf_model, _ = pair
    family = get_family("llm")
    written = family.config_to_hf(model_cfg)
    source = tiny_hf_config_dict(arch)
    for key in ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "intermediate_size"):
        assert written[key] == source[key], (arch, key)
    assert {k: v for k, v in written["rope_scaling"].items() if k != "rope_theta"} == \
        {k: v for k, v in source["rope_scaling"].items() if k != "rope_theta"}, arch
    assert family.config_from_hf(written, "written/config.json") == model_cfg, arch


def test_yarn_changes_logits(pair):
    """YaRN is in force: the same weights with plain RoPE give other logits (the test of parity would
    pass with YaRN ignored only if the two agreed)."""
    import dataclasses

    from loongforge.config.schema import ParallelConfig
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.llm.model import build_model

    arch, model_cfg, hf_model, model = pair
    plain_cfg = dataclasses.replace(model_cfg, language=dataclasses.replace(model_cfg.language, yarn=None))
    plain = build_model(plain_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu").eval()
    load_hf_state_dict(plain, hf_model.state_dict())
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        gap = (model(input_ids=ids, position_ids=text_positions(40))
               - plain(input_ids=ids, position_ids=text_positions(40))).abs().max().item()
    print(f"{arch}: YaRN vs plain RoPE, max |logit diff| {gap:.3g}")
    assert gap > 1e-3
