"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): a hybrid linear-attention VLM. Its vision part is
Qwen3-VL's tower and merger without DeepStack (``models/towers/qwen3_vit/``), its decoder the shared one
with Gated DeltaNet layers between gated full-attention ones (``model.language.layer_types``); ``FAMILY``
is what the rest of loongforge sees of it.

model.py        build_model (the entry point): the composition with interleaved, partial M-RoPE
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
hf_mapping.py   the weight map (rows for ``models.hf.weights``)
chat.py         the chat formats of its versions' templates (Qwen3.6's, Qwen3.8's), by ``model.chat_format``
"""

import functools
from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.parts import composed_fields
from loongforge.models.qwen3_5 import hf_config
from loongforge.models.qwen3_5.chat import chat_format, chat_format_problems
from loongforge.models.qwen3_5.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.qwen_vl.processor import qwen_vl_model_inputs, qwen_vl_processor_files
from loongforge.models.towers.qwen3_vit import PART as TOWER
from loongforge.models.vlm import mrope_index

# The composition's layouts (``models.vlm``), as Qwen3-VL's: vision TP below the language TP, the TP group
# sharing each micro-batch's media; not yet encoder_dp=full.
LAYOUT = replace(DECODER_LAYOUT, encoder_dp_modes=("none", "tp"))

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    build=LazyFunction("loongforge.models.qwen3_5.model:build_model"),
    **composed_fields(TOWER),
    rope="mrope",
    features=frozenset({"hybrid_layers", "partial_rotary", "experts", "shared_expert", "chat_format"}),
    hf_model_inputs=qwen_vl_model_inputs,
    # Qwen3-VL's rule: every video frame a run of its own after its timestamp (transformers' get_rope_index).
    position_ids=functools.partial(mrope_index.position_ids_for, frames_as_images=True),
    # The version's template (Qwen3.6, Qwen3.8: one architecture, templates of their own), else Qwen3-VL's.
    chat=chat_format,
    config_problems=chat_format_problems,
    layout=LAYOUT,
    tiny_preset="qwen3.5-tiny",
    # transformers serves Qwen3.5 with Qwen3-VL's processor (its AutoProcessor maps qwen3_5 to it).
    hf_processor_files=functools.partial(qwen_vl_processor_files, processor_class="Qwen3VLProcessor",
                                         video_processor_class="Qwen3VLVideoProcessor"),
    # Resolves to Qwen3_5ForConditionalGeneration or Qwen3_5MoeForConditionalGeneration by model_type.
    hf_model_class="AutoModelForImageTextToText",
    # The Hub checkpoints' multi-token-prediction head (transformers' Qwen3.5 classes skip it as well).
    hf_unread=("mtp.",),
)
