"""``models.layers.lora_params``: the adapter counts ``--dry-run`` plans with equal the adapters ``apply_lora``
builds (Qwen2.5-VL with all three towers, Qwen3-MoE with its experts), and their per-rank shares split
as the adapters do."""

from __future__ import annotations

import torch

from loongforge.config.schema import LoraConfig, ParallelConfig
from loongforge.models.layers.lora import adapters, apply_lora
from loongforge.models.layers.lora_params import adapter_parameters
from tests.models.helpers import tiny_model_cfg
from tests.models.llm_helpers import tiny_llm_cfg

ALL_TOWERS = LoraConfig(rank=4, alpha=8.0, targets=["language", "vision", "projector"])


def _built_adapter_parameters(build, model_cfg, lora_cfg) -> int:
    model = build(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True, post_process=True,
                  device="cpu")
    apply_lora(model, model_cfg, lora_cfg, seed=0)
    return sum(p.numel() for adapter in adapters(model).values() for p in adapter.parameters())


def test_counts_equal_the_built_adapters(megatron_world_of_one):
    from loongforge.models.llm.model import build_model as build_llm
    from loongforge.models.qwen2_5_vl.model import build_model as build_vlm

    for build, model_cfg, lora_cfg in ((build_vlm, tiny_model_cfg(tie=False), ALL_TOWERS),
                                       (build_llm, tiny_llm_cfg("qwen3_moe"), LoraConfig(rank=4, experts=True))):
        planned = adapter_parameters(model_cfg, lora_cfg, tensor_parallel=1, vision_tensor_parallel=1,
                                     expert_parallel=1)
        built = _built_adapter_parameters(build, model_cfg, lora_cfg)
        print(f"{model_cfg.family}: {built} adapter parameters built, {planned.total} planned")
        assert planned.total == built
        layers = model_cfg.language.num_layers
        assert planned.per_decoder_layer * layers + planned.vision_and_projector == built


def test_per_rank_shares_split_as_the_adapters_do():
    cfg = tiny_model_cfg(tie=False)
    one = adapter_parameters(cfg, ALL_TOWERS, tensor_parallel=1, vision_tensor_parallel=1, expert_parallel=1)
    two = adapter_parameters(cfg, ALL_TOWERS, tensor_parallel=2, vision_tensor_parallel=2, expert_parallel=1)
    # Column-parallel A and row-parallel B stay whole on every rank: a rank holds more than half.
    assert one.per_decoder_layer / 2 < two.per_decoder_layer < one.per_decoder_layer
    assert two.total == one.total
    moe = tiny_llm_cfg("qwen3_moe")
    experts = LoraConfig(rank=4, experts=True)
    ep1 = adapter_parameters(moe, experts, tensor_parallel=1, vision_tensor_parallel=1, expert_parallel=1)
    ep2 = adapter_parameters(moe, experts, tensor_parallel=1, vision_tensor_parallel=1, expert_parallel=2)
    dense = adapter_parameters(moe, LoraConfig(rank=4), tensor_parallel=1, vision_tensor_parallel=1,
                               expert_parallel=1)
    assert ep1.per_decoder_layer - dense.per_decoder_layer == 2 * (ep2.per_decoder_layer - dense.per_decoder_layer)
