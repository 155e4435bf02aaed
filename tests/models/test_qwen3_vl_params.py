"""Qwen3-VL parameter counts by arithmetic equal transformers' on the meta device (every full-size
preset and the tiny one), and the family reads back the config.json it writes."""

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.convert import families
from loongforge.models.registry import get_family

PRESETS = ("qwen3vl-tiny", "qwen3vl-2b", "qwen3vl-4b", "qwen3vl-8b", "qwen3vl-32b")


@pytest.mark.parametrize("preset", PRESETS)
def test_counts_equal_transformers_on_meta_device(preset):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model_cfg = load_run_config(preset).model
    family = get_family(model_cfg.family)
    hf_dict = family.config_to_hf(model_cfg)
    assert families.config_differences(model_cfg, family.config_from_hf(hf_dict, "config.json")) == []
    with torch.device("meta"):
        hf_model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**hf_dict))
    counts = family.count_parameters(model_cfg)
    assert counts["total"] == sum(p.numel() for p in hf_model.parameters())
    assert counts["vision_model"] + counts["projector"] == sum(p.numel() for p in hf_model.model.visual.parameters())
    shapes = {k: tuple(v.shape) for k, v in family.to_hub_style(hf_model.state_dict()).items()}
    if model_cfg.language.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    assert family.hf_shapes(model_cfg) == shapes
