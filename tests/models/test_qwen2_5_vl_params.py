"""Parameter counts by arithmetic: the published 7B number, and transformers' own count with tied
embeddings (every preset against transformers: ``test_counts.py``)."""

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.registry import get_family
from tests.models.helpers import hf_config, tiny_model_cfg

PUBLISHED_7B = 8_292_166_656
count_parameters = get_family("qwen2_5_vl").count_parameters


def test_7b_count_matches_published():
    counts = count_parameters(ModelConfig(family="qwen2_5_vl"))  # the schema defaults are the 7B dims
    assert abs(counts["total"] - PUBLISHED_7B) / PUBLISHED_7B < 1e-3
    assert counts["total"] == counts["vision_model"] + counts["projector"] + counts["language_model"]


def test_tied_tiny_count_matches_transformers():
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_cfg = tiny_model_cfg(tie=True)
    with torch.device("meta"):
        hf_model = Qwen2_5_VLForConditionalGeneration(hf_config(model_cfg))
    assert count_parameters(model_cfg)["total"] == sum(p.numel() for p in hf_model.parameters())
