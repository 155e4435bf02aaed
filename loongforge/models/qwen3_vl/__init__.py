"""Qwen3-VL on megatron-core, dense or with mixture-of-experts decoder layers (Qwen3-VL-MoE:
megatron-core's MoE layer in every decoder layer, ``model.language.moe`` set; the towers,
DeepStack and M-RoPE are the dense model's): its vision part (``models/towers/qwen3_vit/``) composed
with the shared decoder (``models.vlm``); ``FAMILY`` is what the rest of loongforge sees of it.

model.py        build_model (the entry point): the composition with interleaved M-RoPE and DeepStack
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
hf_mapping.py   the weight map (rows for ``models.hf.weights``)
rope_index.py   M-RoPE position ids per sample (data side; ``vlm.mrope_index``'s rule)
processor.py    the processor files of an exported HF folder
"""

from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.qwen_vl.chatml import chatml_vision_timestamped
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.parts import composed_fields
from loongforge.models.qwen_vl.processor import qwen_vl_model_inputs
from loongforge.models.qwen3_vl import hf_config
from loongforge.models.qwen3_vl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.qwen3_vl.processor import processor_files
from loongforge.models.qwen3_vl.rope_index import position_ids_for
from loongforge.models.towers.qwen3_vit import PART as TOWER

# The composition's layouts (``models.vlm``): vision TP below the language TP, the TP group sharing
# each micro-batch's media (DeepStack's features travel with the merger's); not yet encoder_dp=full.
LAYOUT = replace(DECODER_LAYOUT, encoder_dp_modes=("none", "tp"))

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    build=LazyFunction("loongforge.models.qwen3_vl.model:build_model"),
    **composed_fields(TOWER),
    rope="mrope",
    features=frozenset({"experts"}),
    config_problems=hf_config.config_problems,
    hf_model_inputs=qwen_vl_model_inputs,
    position_ids=position_ids_for,
    chat=chatml_vision_timestamped,
    layout=LAYOUT,
    tiny_preset="qwen3vl-tiny",
    hf_processor_files=processor_files,
    # Resolves to Qwen3VLForConditionalGeneration or Qwen3VLMoeForConditionalGeneration by model_type.
    hf_model_class="AutoModelForImageTextToText",
)
