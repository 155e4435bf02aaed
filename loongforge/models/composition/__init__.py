"""A VLM composed in the config from registered parts, with no transformers class behind it: any tower of
``models.parts`` (``model.vision.arch``, with one of its projectors) and any decoder ``models.decoder``
builds (``model.language``: Qwen2/2.5, Qwen3, Llama 3, with or without experts), e.g. Qwen2.5's ViT + patch
merger + a Llama-3-shaped decoder (the ``composition-tiny`` preset). It trains, resumes at any layout,
and encodes as every family does; its checkpoints stay loongforge's: an HF export is refused in one line
(``hf.py``), since no transformers class would read it.

model.py        build_model and the encoder alone, of the run's tower (``model.vision.arch``)
counts.py       parameter and FLOP counts, positions
hf.py           the refusals (config.json, HF export) and the weight rows a loongforge checkpoint uses
chat.py         the chat format: ChatML with Qwen's vision blocks (a videos block for the Qwen towers)
"""

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.models.composition import hf
from loongforge.models.composition.chat import chat_format
from loongforge.models.composition.counts import count_parameters, positions_for, training_flops
from loongforge.models.family import ANY_TOWER, LazyFunction, ModelFamily, no_processor_files
from loongforge.models.decoder.text_config import text_architecture_problems

FAMILY = ModelFamily(
    name="composition",
    hf_architectures=(),  # no config.json names it: HF folders are never read as one
    hf_model_types=(),
    config_from_hf=hf.config_from_hf,
    config_to_hf=hf.config_to_hf,
    hf_shapes=hf.hf_shapes,
    hf_rules=hf.mapping_rules,
    to_hub_style=dict,
    build=LazyFunction("loongforge.models.composition.model:build_model"),
    build_encoder=LazyFunction("loongforge.models.composition.model:build_encoder"),
    count_parameters=count_parameters,
    training_flops=training_flops,
    vision_part=ANY_TOWER,
    rope=None,  # the run's: M-RoPE with model.language.mrope_section, else 1-D
    position_ids=positions_for,
    chat=chat_format,
    layout=DECODER_LAYOUT,
    hf_model_class=None,
    tiny_preset="composition-tiny",
    hf_processor_files=no_processor_files,
    features=frozenset({"text_architecture"}),
    config_problems=text_architecture_problems,
)
