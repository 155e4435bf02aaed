"""Qwen2.5-VL on megatron-core: its vision part (``models/towers/qwen2_5_vit/``) composed with the
shared decoder (``models.vlm``); ``FAMILY`` is what the rest of loongforge sees of it.

model.py        build_model (the entry point): the composition with contiguous M-RoPE
hf_mapping.py   transformers checkpoint <-> this model, per TP rank
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
rope_index.py   M-RoPE position ids per sample (data side; ``vlm.mrope_index``'s rule)
processor.py    the processor files of an exported HF folder
chat.py         the chat format (ChatML with vision blocks)
"""


from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.parts import composed_fields
from loongforge.models.qwen_vl.processor import qwen_vl_model_inputs
from loongforge.models.qwen2_5_vl import hf_config
from loongforge.models.qwen2_5_vl.chat import chat_format
from loongforge.models.qwen2_5_vl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.qwen2_5_vl.processor import processor_files
from loongforge.models.qwen2_5_vl.rope_index import position_ids_for
from loongforge.models.towers.qwen2_5_vit import PART as TOWER

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    # Imported at the first build: megatron-core takes seconds, and a parameter count, a dry-run
    # plan or a config.json read should not pay for it.
    build=LazyFunction("loongforge.models.qwen2_5_vl.model:build_model"),
    **composed_fields(TOWER),
    rope="mrope",
    hf_model_inputs=qwen_vl_model_inputs,
    position_ids=position_ids_for,
    chat=chat_format,
    # Megatron's decoder and ViT layers need nothing beyond the decoder rule; the vision TP groups
    # are cut from the language TP groups (vlm/process_groups.py), which the rule includes.
    layout=DECODER_LAYOUT,
    hf_model_class="Qwen2_5_VLForConditionalGeneration",
    tiny_preset="qwen2.5vl-tiny",
    hf_processor_files=processor_files,
)
