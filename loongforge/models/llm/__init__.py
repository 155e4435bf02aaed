"""Text-only causal LLMs (Qwen (1.0) / Qwen1.5 / Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE, Qwen2-MoE, Qwen3-Next, Llama 2 /
3.x, DeepSeek-V2 / V3 / V3.2, MiniMax-M2, MiMo-V2-Flash) on megatron-core; ``FAMILY`` is what the rest of loongforge sees
of them. Qwen3-MoE is Qwen3 with megatron-core's MoE layer in every decoder layer (``model.language.moe``;
``models.decoder.layer_specs.moe_spec``); Qwen2-MoE is Qwen2 with it and a gated shared expert; Qwen (1.0) is
Qwen2's decoder under its own key layout; Qwen3-Next is the hybrid decoder of Qwen3.5 (Gated DeltaNet and gated
attention, ``model.language.layer_types``) under 1-D partial RoPE, with Qwen2-MoE's gated shared expert.

model.py      TextModel and build_model: the shared decoder with 1-D RoPE
hf_config.py  HF config.json <-> ModelConfig for the architectures, and their tensor shapes
hf_mapping.py the weight map (the decoder's rows)
qwen1.py      Qwen (1.0)'s config.json and key layout (no transformers class)
params.py     parameter counts by arithmetic (total, and active per token)
flops.py      model FLOPs of a training micro-batch (MFU)
positions.py  per-sample rotary positions
chat.py       the chat formats (ChatML, Qwen3's, Llama 3's, Llama 2's, DeepSeek's), chosen by architecture or name
"""

from loongforge.config.layout import DECODER_LAYOUT
from loongforge.config.schema import ModelConfig
from loongforge.models.family import (
    LazyFunction,
    ModelFamily,
    hf_facts,
    no_processor_files,
)
from loongforge.models.decoder.deepseek_config import mtp_layers_held
from loongforge.models.llm import hf_config
from loongforge.models.llm.chat import chat_format, chat_format_problems
from loongforge.models.llm.minimax_m2 import MINIMAX_M2_ARCHITECTURE, minimax_m2_problems
from loongforge.models.llm.qwen1 import architecture_problems
from loongforge.models.llm.flops import training_flops
from loongforge.models.llm.hf_mapping import mapping_rules, to_hub_style
from loongforge.models.llm.params import count_parameters
from loongforge.models.llm.positions import position_ids_for


def config_problems(model_cfg: ModelConfig) -> list[str]:
    """``ModelFamily.config_problems``: the stated architecture's (Qwen 1.0's its own), and a chat format of another
    family's."""
    if model_cfg.language.architecture == MINIMAX_M2_ARCHITECTURE:
        return minimax_m2_problems(model_cfg.language) + chat_format_problems(model_cfg)
    return architecture_problems(model_cfg) + chat_format_problems(model_cfg)


FAMILY = ModelFamily(
    **hf_facts(hf_config),
    hf_rules=mapping_rules,
    to_hub_style=to_hub_style,
    build=LazyFunction("loongforge.models.llm.model:build_model"),
    build_encoder=None,
    count_parameters=count_parameters,
    training_flops=training_flops,
    position_ids=position_ids_for,
    chat=chat_format,
    layout=DECODER_LAYOUT,
    hf_model_class="AutoModelForCausalLM",
    tiny_preset="llm-tiny",
    hf_processor_files=no_processor_files,
    config_for_tensors=mtp_layers_held,
    features=frozenset({"experts", "shared_expert", "latent_attention", "chat_format", "text_architecture",
                        "partial_rotary", "layer_qk_norm", "hybrid_layers", "sliding_window", "sparse_attention"}),
    config_problems=config_problems,
    # The multi-token-prediction heads of the Hub's MiMo-V2-Flash (``model.mtp.*``) and Qwen3-Next (``mtp.*``)
    # checkpoints: transformers' classes have none and ignore them on loading.
    hf_unread=("model.mtp.", "mtp."),
)
