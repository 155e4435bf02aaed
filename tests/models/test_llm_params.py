"""Parameter counts of the text-only presets by arithmetic equal transformers' on the meta device and
the published totals; the tiny preset's HF config builds the same model."""

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.models.registry import get_family

PRESETS = ("qwen2.5-7b", "qwen3-8b", "llama3.1-8b", "llm-tiny", "llama-tiny")


@pytest.mark.parametrize("preset", PRESETS)
def test_counts_equal_transformers_on_meta_device(preset):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_cfg = load_run_config(preset).model
    family = get_family(model_cfg.family)
    hf_dict = family.config_to_hf(model_cfg)
    hf_config = AutoConfig.for_model(hf_dict["model_type"], **{k: v for k, v in hf_dict.items() if k != "model_type"})
    assert hf_config.architectures == hf_dict["architectures"]
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    total = family.count_parameters(model_cfg)["total"]
    assert total == sum(p.numel() for p in hf_model.parameters())
    if model_cfg.reference_num_params is not None:
        assert total == model_cfg.reference_num_params
