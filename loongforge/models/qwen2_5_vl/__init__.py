"""Qwen2.5-VL on megatron-core; ``FAMILY`` is what the rest of loongforge sees of it.

model.py        Qwen2_5_VLModel and build_model (the entry point)
vision.py       the ViT tower and patch merger (window attention, 2-D RoPE)
layer_specs.py  the vision layer spec (the decoder block of ``models.decoder``, bidirectional)
configs.py      ModelConfig -> megatron TransformerConfigs
process_groups.py  the vision tower's own tensor-parallel groups
encoder.py      the vision encoder alone (loongforge encode)
encoder_full.py    parallel.encoder_dp=full: the TP x PP group divides a whole step's media
hf_mapping.py   transformers checkpoint <-> this model, per TP rank
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
params.py       parameter counts by arithmetic
flops.py        model FLOPs of a training micro-batch (MFU)
rope_index.py   M-RoPE position ids per sample (data side)
processor.py    the processor files of an exported HF folder
chat.py         the chat format (ChatML with vision blocks)
"""

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.family import LazyFunction, ModelFamily
from loongforge.models.hf_rules import padded_vocab_size
from loongforge.models.qwen2_5_vl import hf_config
from loongforge.models.qwen2_5_vl.chat import chat_format
from loongforge.models.qwen2_5_vl.flops import training_flops
from loongforge.models.qwen2_5_vl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.qwen2_5_vl.params import count_parameters
from loongforge.models.qwen2_5_vl.processor import processor_files
from loongforge.models.qwen2_5_vl.rope_index import position_ids_for

FAMILY = ModelFamily(
    name=hf_config.NAME,
    hf_architectures=hf_config.HF_ARCHITECTURES,
    hf_model_types=hf_config.HF_MODEL_TYPES,
    config_from_hf=hf_config.model_config_from_hf,
    config_to_hf=hf_config.hf_config_from_model,
    hf_shapes=hf_config.expected_hf_shapes,
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    padded_vocab_size=padded_vocab_size,
    # Imported at the first build: megatron-core takes seconds, and a parameter count, a dry-run
    # plan or a config.json read should not pay for it.
    build=LazyFunction("loongforge.models.qwen2_5_vl.model:build_model"),
    build_encoder=LazyFunction("loongforge.models.qwen2_5_vl.encoder:build_encoder"),
    count_parameters=count_parameters,
    training_flops=training_flops,
    position_ids=position_ids_for,
    chat=chat_format,
    # Megatron's decoder and ViT layers need nothing beyond the decoder rule; the vision TP groups
    # are cut from the language TP groups (process_groups.py), which the rule includes.
    layout=DECODER_LAYOUT,
    hf_model_class="Qwen2_5_VLForConditionalGeneration",
    has_vision=True,
    tiny_preset="qwen2.5vl-tiny",
    hf_processor_files=processor_files,
)
