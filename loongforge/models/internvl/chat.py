"""InternVL3.5's chat format: ChatML (its Qwen3 language model's) where an image is ``<IMG_CONTEXT>`` and a
newline in the text; transformers' ``InternVLProcessor`` writes it as ``<img>`` + 256 x tiles
``<IMG_CONTEXT>`` + ``</img>`` (``ChatFormat.wraps_images``: ``data.measure`` does the same after
tokenizing). Its processor writes a video as frames of images; loongforge's InternVL trains on images.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.qwen_vl.chatml import CHATML_VISION, chatml_vision_template
from loongforge.models.family import ChatFormat

IMAGE_BLOCK = "<IMG_CONTEXT>\n"

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


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    return CHAT
