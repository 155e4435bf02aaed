"""InternVL2.5 and 3.5 on megatron-core: its vision part (``models/towers/intern_vit/``: InternViT and the
pixel-shuffle projector) composed with the shared decoder (Qwen2.5 for 2.5, Qwen3 for 3.5) under 1-D RoPE;
``FAMILY`` is what the rest of loongforge sees of it. The decoder decides the version: its tokenizer and chat
template (``chat.py``). InternVL2.5's InternLM2.5-based sizes (2B, 8B, 26B) are not offered: their -hf
folders are Llama decoders on InternLM2's SentencePiece tokenizer (92,553 ids), which neither loongforge nor
transformers builds offline, so no preset could tokenize for them and no reference here could prove them.

model.py        build_model (the entry point)
hf_mapping.py   transformers checkpoint <-> this model, per TP rank
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
processor.py    the processor files of an exported HF folder
chat.py         the chat formats (ChatML; an image is <img> + its tiles' <IMG_CONTEXT> + </img>) and tokenizers
"""

from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.internvl import hf_config
from loongforge.models.internvl.chat import chat_format, offline_tokenizer
from loongforge.models.internvl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.internvl.processor import processor_files
from loongforge.models.parts import composed_fields
from loongforge.models.towers.intern_vit import PART as TOWER
from loongforge.models.vlm.positions import sequential_positions_for
from loongforge.models.decoder.text_config import text_architecture_problems

# The composition's layouts proven for it: vision TP below the language TP, the TP group sharing each
# micro-batch's tiles (tests/models/test_encoder_dp.py); encoder_dp=full is not proven for it yet.
LAYOUT = replace(DECODER_LAYOUT, encoder_dp_modes=("none", "tp"))

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    # Imported at the first build: megatron-core takes seconds.
    build=LazyFunction("loongforge.models.internvl.model:build_model"),
    **composed_fields(TOWER),
    position_ids=sequential_positions_for,
    # The batch's tile patch rows as the tiles [n, C, S, S] its processor returns (torch: imported at the call).
    hf_model_inputs=LazyFunction("loongforge.models.internvl.hf_inputs:model_inputs"),
    chat=chat_format,
    layout=LAYOUT,
    hf_model_class="InternVLForConditionalGeneration",
    tiny_preset="internvl3.5-tiny",
    hf_processor_files=processor_files,
    features=frozenset({"text_architecture"}),
    config_problems=text_architecture_problems,
    offline_tokenizer=offline_tokenizer,
)
