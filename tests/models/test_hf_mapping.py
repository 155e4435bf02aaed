"""hf_mapping: both HF key styles read alike; HF -> TP shards -> HF is the identity."""

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import hf_to_megatron, megatron_to_hf
from loongforge.models.qwen2_5_vl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.qwen2_5_vl.model import build_model
from tests.models.helpers import build_hf_model, tiny_model_cfg


@pytest.fixture
def keys_and_hf_state(megatron_world_of_one):
    model_cfg = tiny_model_cfg(tie=False)
    model = build_model(
        model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu"
    )
    return model_cfg, list(model.state_dict().keys()), build_hf_model(model_cfg).state_dict()


def test_both_key_styles_convert_alike(keys_and_hf_state):
    model_cfg, keys, hf_state = keys_and_hf_state
    assert any(k.startswith("model.language_model.") for k in hf_state)  # transformers 5 style
    hub_state = to_hub_style(hf_state)
    assert "visual.blocks.0.attn.qkv.weight" in hub_state and "model.layers.0.mlp.up_proj.weight" in hub_state
    new_style = hf_to_megatron(hf_state, model_cfg, keys)
    hub_style = hf_to_megatron(hub_state, model_cfg, keys)
    assert new_style.keys() == hub_style.keys()
    assert all(torch.equal(new_style[k], hub_style[k]) for k in new_style)


@pytest.mark.parametrize("tp_size, vision_tp_size", [(1, 1), (2, 2), (2, 1), (4, 2)])
def test_round_trip_through_tp_shards(keys_and_hf_state, tp_size, vision_tp_size):
    model_cfg, keys, hf_state = keys_and_hf_state
    shards = [
        hf_to_megatron(
            hf_state, model_cfg, keys, tp_rank=rank, tp_size=tp_size,
            vision_tp_rank=rank % vision_tp_size, vision_tp_size=vision_tp_size,
        )
        for rank in range(tp_size)
    ]
    qkv = "language_model.decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] == 256 // tp_size  # (heads + 2 groups) * head_dim, split
    back = megatron_to_hf(shards, model_cfg, vision_tp_size=vision_tp_size)
    expected = to_hub_style(hf_state)
    assert back.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(back[key], tensor), key


def test_tied_checkpoint_without_lm_head_fills_output_layer(keys_and_hf_state):
    model_cfg, _, hf_state = keys_and_hf_state
    hub_state = {k: v for k, v in to_hub_style(hf_state).items() if k != "lm_head.weight"}
    out = hf_to_megatron(hub_state, model_cfg, ["language_model.output_layer.weight"])
    assert torch.equal(out["language_model.output_layer.weight"], hub_state["model.embed_tokens.weight"])


def test_pipeline_stage_layers_map_to_global_hf_layers(keys_and_hf_state):
    model_cfg, _, hf_state = keys_and_hf_state
    key = "language_model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    out = hf_to_megatron(hf_state, model_cfg, [key], layer_offset=1)
    assert torch.equal(out[key], to_hub_style(hf_state)["model.layers.1.input_layernorm.weight"])


def test_separate_norm_names_map_like_fused_ones(keys_and_hf_state):
    """Keys of megatron's separate-norm layout (older checkpoints) find the same HF tensors."""
    model_cfg, _, hf_state = keys_and_hf_state
    hub = to_hub_style(hf_state)
    pairs = {"language_model.decoder.layers.1.pre_mlp_layernorm.weight": "model.layers.1.post_attention_layernorm.weight",
             "vision_model.layers.0.input_layernorm.weight": "visual.blocks.0.norm1.weight"}
    out = hf_to_megatron(hf_state, model_cfg, list(pairs))
    for key, hf_key in pairs.items():
        assert torch.equal(out[key], hub[hf_key])
    back = megatron_to_hf([out], model_cfg)
    assert set(back) == set(pairs.values())


def test_every_rule_names_distinct_keys():
    rules = mapping_rules(tiny_model_cfg())
    assert len({r.megatron for r in rules}) == len(rules)
    assert len({k for r in rules for k in r.hf}) == sum(len(r.hf) for r in rules)


def test_unknown_key_is_reported(keys_and_hf_state):
    model_cfg, _, hf_state = keys_and_hf_state
    with pytest.raises(KeyError, match="no hf_mapping rule"):
        hf_to_megatron(hf_state, model_cfg, ["language_model.mystery.weight"])
