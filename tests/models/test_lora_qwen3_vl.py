"""LoRA on Qwen3-VL, dense and MoE (issue 31, acceptance 1): the language model's adapters, read from
PEFT's tensors through ``lora_rules``, give transformers + PEFT's logits on an image sample at fp32
(Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration; in the MoE model the
attention's q/k/v/o are adapted, its experts are fused tensors PEFT has no modules for)."""

from __future__ import annotations

import functools

import pytest
import torch

from loongforge.config.schema import LoraConfig, ParallelConfig
from loongforge.models.qwen3_vl.model import build_model
from tests.models.test_lora import LANGUAGE_TARGETS, _lora_model, peft_tensors, with_random_adapters
from tests.models.test_qwen3_vl_support import (
    TINY_VISION,
    build_hf_model,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-5


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
def test_qwen3_vl_language_adapters_match_peft(megatron_world_of_one, experts):
    model_cfg = tiny_model_cfg(experts=experts)
    hf_model = build_hf_model(model_cfg)
    hf_state = {key: value.clone() for key, value in hf_model.state_dict().items()}
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    positions = hf_position_ids(hf_model, sample)
    peft_model = with_random_adapters(hf_model, LANGUAGE_TARGETS)
    build = functools.partial(build_model, vision=TINY_VISION)
    model, counts = _lora_model(build, model_cfg, ParallelConfig(), hf_state, peft_tensors(peft_model),
                                LoraConfig(rank=4, alpha=8.0))
    layers = model_cfg.language.num_layers
    kinds = ("proj", "qkv") if experts else ("fc1", "fc2", "proj", "qkv")
    assert counts == {f"language.{kind}": layers for kind in kinds}
    inputs = our_inputs(sample, positions)
    with torch.no_grad():
        reference = peft_model(**{**inputs, "position_ids": positions}).logits  # [1, s, V]
        with peft_model.disable_adapter():
            without = peft_model(**inputs).logits
        logits = model(**inputs)
    error, moved = (logits - reference).abs().max().item(), (reference - without).abs().max().item()
    print(f"Qwen3-VL {'MoE' if experts else 'dense'} LoRA logits vs PEFT: {error:.2e} (the adapters move them {moved:.2e})")
    assert error <= TOLERANCE and moved > 1000 * TOLERANCE
