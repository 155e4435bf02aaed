"""Config reading (flat and nested HF configs) and the tensor names/shapes a config implies."""

from __future__ import annotations

import pytest

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config
from loongforge.convert import families
from loongforge.convert.engine import build_links
from loongforge.models.decoder.text_config import language_from_hf, language_to_hf
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


def test_dynamic_rope_scaling_reads_writes_back_and_bounds_the_rows():
    """InternVL2.5's text configs state dynamic NTK scaling (factor 2): read in either spelling, written back as
    transformers reads it, trained as plain RoPE, so a row past max_position_embeddings is refused; a kind
    loongforge does not build (yarn on a Qwen2 decoder) stops naming it."""
    cfg = load_run_config("internvl2.5-4b")
    text = language_to_hf(cfg.model.language)
    assert text["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0}
    for scaling in ({"type": "dynamic", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}):
        read = language_from_hf({**text, "rope_scaling": scaling}, "config.json")
        assert (read.rope_scaling_factor, read.rope_scaling_type) == (2.0, "dynamic")
    assert language_from_hf(text, "config.json") == cfg.model.language
    with pytest.raises(ConfigError, match="data.seq_len=65536 is past model.language.max_position_embeddings=32768"):
        load_run_config("internvl2.5-4b", overrides=["data.seq_len=65536"])
    with pytest.raises(InputError, match="rope_scaling type 'yarn' is not supported"):
        language_from_hf({**text, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "config.json")
