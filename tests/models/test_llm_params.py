"""Parameter counts of the text-only presets by arithmetic equal transformers' on the meta device and
the published totals; the tiny preset's HF config builds the same model."""

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.models.registry import get_family

PRESETS = ("qwen2.5-7b", "qwen3-8b", "llama3.1-8b", "llm-tiny", "llama-tiny", "deepseek-v3", "moonlight-16b-a3b",
           "deepseek-v2-lite", "deepseek-v3-tiny")


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
    counts = family.count_parameters(model_cfg)
    total = counts["total"]
    assert total == sum(p.numel() for p in hf_model.parameters())
    lang = model_cfg.language
    if lang.num_experts:
        # Active: all but the experts a token does not run through, in every sparse layer transformers builds.
        per_expert = sum(p.numel() for name, p in hf_model.named_parameters() if ".experts." in name) // (
            lang.num_experts * (lang.num_layers - lang.first_dense_layers))
        idle = (lang.num_experts - lang.moe_router_topk) * per_expert * (lang.num_layers - lang.first_dense_layers)
        print(f"{preset}: total {total:,}, active {counts['active']:,}")
        assert counts["active"] == total - idle
    if model_cfg.reference_num_params is not None:
        assert total == model_cfg.reference_num_params
