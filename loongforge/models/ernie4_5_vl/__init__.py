"""ERNIE-4.5-VL (transformers' ``Ernie4_5_VLMoeForConditionalGeneration``) on megatron-core: its vision part
(``models/towers/ernie_vit/``: the ViT and the variable-resolution resampler) composed with the shared decoder,
whose sparse layers hold modality-isolated experts (``decoder.modality_moe``: text tokens to the text experts,
image tokens and their markers to the vision experts, shared experts for all) under interleaved-pair 3-D RoPE
(``vlm.paired_mrope``); ``FAMILY`` is what the rest of loongforge sees of it.

model.py        build_model (the entry point)
hf_config.py    HF config.json <-> ModelConfig, the HF tensor shapes a config implies, its models' checks
hf_mapping.py   the weight map (rows for ``models.hf.weights``) and the key styles it reads
hf_inputs.py    transformers' forward inputs from a batch (``--check-logits``), the experts' routing ids
rope_index.py   3-D position ids per sample (data side)
chat.py         the chat format
processor.py    the processor files of an exported HF folder
"""

from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.ernie4_5_vl import hf_config
from loongforge.models.ernie4_5_vl.chat import chat_format
from loongforge.models.ernie4_5_vl.hf_inputs import model_inputs
from loongforge.models.ernie4_5_vl.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.ernie4_5_vl.processor import processor_files
from loongforge.models.ernie4_5_vl.rope_index import position_ids_for
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.parts import composed_fields
from loongforge.models.towers.ernie_vit import PART as TOWER

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    build=LazyFunction("loongforge.models.ernie4_5_vl.model:build_model"),
    **composed_fields(TOWER),
    rope="mrope",
    # The modality-isolated experts, their ungated shared experts, the dense first layers and fp32 routers (the
    # last three are gated with DeepSeek's options; its latent attention is refused by config_problems).
    features=frozenset({"experts", "shared_expert", "modality_experts", "latent_attention"}),
    config_problems=hf_config.config_problems,
    hf_model_inputs=model_inputs,
    position_ids=position_ids_for,
    chat=chat_format,
    # The TP group may share each micro-batch's images (encoder_dp=tp); sharing them over CP, or a step's over the
    # model-parallel group, is not proven for the resampler yet.
    layout=replace(DECODER_LAYOUT, encoder_dp_modes=("none", "tp"), encoder_cp=False),
    hf_model_class="Ernie4_5_VLMoeForConditionalGeneration",
    tiny_preset="ernie4.5vl-tiny",
    hf_processor_files=processor_files,
)
