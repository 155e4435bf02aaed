"""LLaVA-OneVision-1.5 on megatron-core: its vision part (``models/towers/rice_vit/``: RICE-ViT and its patch
merger) composed with the shared decoder (Qwen3) under 1-D RoPE; ``FAMILY`` is what the rest of loongforge
sees of it.

model.py        build_model (the entry point)
hf_mapping.py   transformers checkpoint <-> this model, per TP rank, and the key styles read
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
processor.py    the processor files of an exported HF folder
chat.py         the chat format (Qwen2-VL's: ChatML with vision blocks)
"""

from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.decoder.text_config import text_architecture_problems
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.llava_onevision1_5 import hf_config
from loongforge.models.llava_onevision1_5.chat import chat_format
from loongforge.models.llava_onevision1_5.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.llava_onevision1_5.processor import processor_files
from loongforge.models.parts import composed_fields
from loongforge.models.qwen_vl.processor import qwen_vl_model_inputs
from loongforge.models.towers.rice_vit import PART as TOWER
from loongforge.models.vlm.positions import sequential_positions_for

# The composition's layouts proven for it: vision TP below the language TP (tests/models/test_tp_parity.py,
# test_llava_onevision1_5.py), the TP group sharing each micro-batch's images (encoder_dp=tp,
# tests/models/test_encoder_dp.py); encoder_dp=full is not proven for it yet.
LAYOUT = replace(DECODER_LAYOUT, encoder_dp_modes=("none", "tp"))

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    # Imported at the first build: megatron-core takes seconds.
    build=LazyFunction("loongforge.models.llava_onevision1_5.model:build_model"),
    **composed_fields(TOWER),
    position_ids=sequential_positions_for,
    # Qwen's processor's outputs: patch rows and grids as they are.
    hf_model_inputs=qwen_vl_model_inputs,
    chat=chat_format,
    layout=LAYOUT,
    hf_model_class="LlavaOnevision15ForConditionalGeneration",
    tiny_preset="llava-onevision1.5-tiny",
    hf_processor_files=processor_files,
    features=frozenset({"text_architecture"}),
    config_problems=text_architecture_problems,
)
