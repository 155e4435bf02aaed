"""Qwen3-VL-MoE in the qwen3_vl family: its published sizes (the counts against transformers for every
preset: ``test_counts.py``); the config.json it writes is transformers' and reads back; configs it cannot
build are refused with the file and the key."""

import pytest

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.convert import families
from loongforge.models.registry import family_of_hf_config, get_family


def test_published_sizes():
    """Qwen3-VL-30B-A3B: 31.07B parameters (as the Hub checkpoint's listings give); its decoder is
    Qwen3-30B-A3B's parameter for parameter (30.5B); about 3.3B of the decoder active per token."""
    counts = get_family("qwen3_vl").count_parameters(load_run_config("qwen3vl-30b-a3b").model)
    assert round(counts["total"] / 1e9, 2) == 31.07
    text_only = get_family("llm").count_parameters(load_run_config("qwen3-30b-a3b").model)
    assert counts["language_model"] == text_only["total"]
    assert counts["active"] - counts["vision_model"] - counts["projector"] == text_only["active"]
    big = get_family("qwen3_vl").count_parameters(load_run_config("qwen3vl-235b-a22b").model)
    assert round(big["total"] / 1e9) == 236 and round(big["active"] / 1e9) == 23


def test_dense_qwen3_vl_counts_every_parameter_active():
    counts = get_family("qwen3_vl").count_parameters(load_run_config("qwen3vl-8b").model)
    assert counts["active"] == counts["total"]


def test_config_json_round_trips_through_transformers():
    """Ours -> config.json -> transformers' Qwen3VLMoeConfig.to_dict() (which writes
    num_local_experts) -> ours: the same model; the family is found by its architecture."""
    from transformers import Qwen3VLMoeConfig

    model_cfg = load_run_config("qwen3vl-30b-a3b").model
    family = get_family("qwen3_vl")
    hf_dict = family.config_to_hf(model_cfg)
    assert (hf_dict["model_type"], hf_dict["text_config"]["model_type"]) == ("qwen3_vl_moe", "qwen3_vl_moe_text")
    text = hf_dict["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]) == (128, 8, 768)
    through_transformers = Qwen3VLMoeConfig(**hf_dict).to_dict()
    assert "num_experts" not in through_transformers["text_config"]
    assert family_of_hf_config(through_transformers, "config.json") is family
    again = family.config_from_hf(through_transformers, "config.json")
    assert families.config_differences(model_cfg, again) == []
    # Read by model_type alone too (architectures absent).
    del through_transformers["architectures"]
    assert family.config_from_hf(through_transformers, "config.json").language.moe.num_experts == 128


def test_dense_config_is_still_written_as_qwen3_vl():
    hf_dict = get_family("qwen3_vl").config_to_hf(load_run_config("qwen3vl-8b").model)
    assert hf_dict["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert "num_experts" not in hf_dict["text_config"]


def _moe_config_json(**text_fields) -> dict:
    hf_dict = get_family("qwen3_vl").config_to_hf(load_run_config("qwen3vl-moe-tiny").model)
    hf_dict["text_config"].update(text_fields)
    return hf_dict


@pytest.mark.parametrize("fields, message", [
    (dict(decoder_sparse_step=2), r"^ckpt/config.json: text_config.decoder_sparse_step=2, "
                                  r"text_config.mlp_only_layers=\[\]: loongforge's Qwen3-VL-MoE makes every layer sparse"),
    (dict(mlp_only_layers=[0]), r"text_config.mlp_only_layers=\[0\]"),
    (dict(norm_topk_prob=False), r"^ckpt/config.json: text_config.norm_topk_prob=False: transformers' Qwen3-VL-MoE"),
    (dict(num_experts=0), r"^ckpt/config.json: a Qwen3-VL-MoE config needs text_config.num_experts"),
])
def test_configs_it_cannot_build_are_refused_naming_file_and_key(fields, message):
    with pytest.raises(InputError, match=message) as raised:
        get_family("qwen3_vl").config_from_hf(_moe_config_json(**fields), "ckpt/config.json")
    assert "\n" not in str(raised.value)


def test_unnormalised_router_is_refused_by_validation_and_export():
    from loongforge.models.registry import check_family_layout

    cfg = load_run_config("qwen3vl-moe-tiny")
    cfg.model.language.moe.norm_topk_prob = False
    with pytest.raises(ConfigError) as info:
        check_family_layout(cfg)
    assert any(e.startswith("model.language.moe.norm_topk_prob=false: Qwen3-VL-MoE always renormalises")
               for e in info.value.messages)
    with pytest.raises(ValueError, match="norm_topk_prob=false has no Qwen3-VL-MoE config.json"):
        get_family("qwen3_vl").config_to_hf(cfg.model)
