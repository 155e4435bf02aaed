"""Config reading (flat and nested HF configs) and the tensor names/shapes a config implies."""

from __future__ import annotations

import pytest

from loongforge.convert import families
from loongforge.convert.engine import build_links
from loongforge.models.registry import get_family
from tests.convert.helpers import hub_style_config
from tests.models.helpers import build_hf_model, hf_config, tiny_model_cfg

FAMILY = get_family("qwen2_5_vl")


@pytest.mark.parametrize("tie", [True, False])
def test_expected_shapes_are_transformers_shapes(tie):
    model_cfg = tiny_model_cfg(tie=tie)
    state = FAMILY.to_hub_style(build_hf_model(model_cfg).state_dict())
    if tie:
        state.pop("lm_head.weight")  # tied: not saved by save_pretrained
    assert FAMILY.hf_shapes(model_cfg) == {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("tie", [True, False])
def test_nested_and_flat_configs_read_alike(tie):
    model_cfg = tiny_model_cfg(tie=tie)
    nested = hf_config(model_cfg).to_dict()  # transformers 5: text_config + rope_parameters
    flat = hub_style_config(model_cfg)  # Hub: flat + rope_theta + rope_scaling + in_chans
    for cfg in (nested, flat, FAMILY.config_to_hf(model_cfg)):
        found = FAMILY.config_from_hf(cfg, "config.json")
        assert families.config_differences(model_cfg, found) == []
        assert found.tokens == model_cfg.tokens


def test_every_hf_tensor_is_linked_once():
    for tie in (True, False):
        model_cfg = tiny_model_cfg(tie=tie)
        linked = [k for link in build_links(model_cfg) for k in link.hf_keys]
        assert sorted(linked) == sorted(FAMILY.hf_shapes(model_cfg))
