"""InternVL's chat formats: ChatML where an image is ``<IMG_CONTEXT>`` and a newline in the text;
transformers' ``InternVLProcessor`` writes it as ``<img>`` + 256 x tiles ``<IMG_CONTEXT>`` + ``</img>``
(``ChatFormat.wraps_images``: ``data.measure`` does the same after tokenizing). Its processor writes a
video as frames of images; loongforge's InternVL trains on images.

The version follows the language model. InternVL2.5 (and 3.0) on Qwen2.5 train with InternVL's
``internvl2_5`` conversation, whose system turn, when a conversation has none, introduces the model
(``INTERNVL2_5_SYSTEM_PROMPT``); InternVL3.5 on Qwen3 writes none, as its -HF template.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.qwen_vl.chatml import CHATML_VISION, chatml_vision_template
from loongforge.models.family import ChatFormat

IMAGE_BLOCK = "<IMG_CONTEXT>\n"
# The default system message of InternVL's ``internvl2_5`` conversation template.
INTERNVL2_5_SYSTEM_PROMPT = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的"
                             "多模态大语言模型。")
# The language models of the versions that write INTERNVL2_5_SYSTEM_PROMPT.
QWEN2_DECODERS = ("Qwen2ForCausalLM",)

CHAT = replace(
    CHATML_VISION,
    image_block=IMAGE_BLOCK,
    video_block="",
    video_rule=None,
    jinja_template=chatml_vision_template(IMAGE_BLOCK, "", None),
    default_system_prompt=None,
    vision_tokens=(("<IMG_CONTEXT>", "image_token_id"), ("<img>", "vision_start_token_id"),
                   ("</img>", "vision_end_token_id")),
    wraps_images=True,
)

CHAT_2_5 = replace(CHAT, jinja_template=chatml_vision_template(IMAGE_BLOCK, "", INTERNVL2_5_SYSTEM_PROMPT),
                   default_system_prompt=INTERNVL2_5_SYSTEM_PROMPT)


def is_internvl2_5(model_cfg: ModelConfig) -> bool:
    """Whether ``model_cfg`` is of the Qwen2.5-based versions (InternVL2.5, 3.0)."""
    return model_cfg.language.architecture in QWEN2_DECODERS


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    return CHAT_2_5 if is_internvl2_5(model_cfg) else CHAT


def offline_tokenizer(model_cfg: ModelConfig) -> str:
    """The version's tokenizer (``data.tokenizer``): its tokens follow its language model's."""
    return "internvl2.5" if is_internvl2_5(model_cfg) else "internvl3.5"
