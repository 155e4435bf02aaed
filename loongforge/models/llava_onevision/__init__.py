"""LLaVA-OneVision on megatron-core: SigLIP and the MLP projector (``models/towers/siglip/``) with its own
anyres processing and packing, composed with the shared decoder (Qwen2) under 1-D RoPE; ``FAMILY`` is what
the rest of loongforge sees of it.

model.py        build_model (the entry point); ``VISION``: its vision part
encoder.py      SigLIP + projector + the anyres packing with its newline, as one ``VisionEncoder``
anyres.py       the image processor: an image -> its base image and crops, and its placeholder tokens
packing.py      an image's per-square features -> its placeholders' (unpadded, newlines)
hf_mapping.py   transformers checkpoint <-> this model, per TP rank
hf_config.py    HF config.json <-> ModelConfig, and the HF tensor shapes a config implies
hf_inputs.py    transformers' forward inputs from a batch (convert --check-logits)
processor.py    the processor files of an exported HF folder
chat.py         the chat format (ChatML; a turn's images first, then its text)
"""

from dataclasses import replace

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.family import LazyFunction, ModelFamily, hf_facts
from loongforge.models.llava_onevision import hf_config
from loongforge.models.llava_onevision.chat import chat_format
from loongforge.models.llava_onevision.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.llava_onevision.processor import processor_files
from loongforge.models.parts import composed_fields
from loongforge.models.llava_onevision.vision import VISION, anyres_problems
from loongforge.models.vlm.positions import sequential_positions_for
from loongforge.models.decoder.text_config import text_architecture_problems

def config_problems(model_cfg) -> list[str]:
    return text_architecture_problems(model_cfg) + anyres_problems(model_cfg)


# Its encoder reads each image whole (it packs an image's features by its size), so it runs them where it is:
# no encoder_dp or encoder_cp sharing (vision TP below the language TP applies).
LAYOUT = replace(DECODER_LAYOUT, encoder_dp_modes=("none",), encoder_cp=False)

FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    # Imported at the first build: megatron-core takes seconds.
    build=LazyFunction("loongforge.models.llava_onevision.model:build_model"),
    **composed_fields(VISION),
    position_ids=sequential_positions_for,
    # The batch's square patch rows as the padded squares its processor returns (torch: at the call).
    hf_model_inputs=LazyFunction("loongforge.models.llava_onevision.hf_inputs:model_inputs"),
    chat=chat_format,
    layout=LAYOUT,
    hf_model_class="LlavaOnevisionForConditionalGeneration",
    tiny_preset="llava-onevision-tiny",
    hf_processor_files=processor_files,
    features=frozenset({"text_architecture"}),
    config_problems=config_problems,
)
