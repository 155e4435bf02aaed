"""LLaVA-OneVision-1.5's chat format: ChatML with Qwen's vision blocks (its processor is Qwen2-VL's image
processor with Qwen's tokenizer): an image is ``<|vision_start|><|image_pad|><|vision_end|>``, the pad expanded
after tokenizing to ``h * w / merge^2`` copies; the default system turn is Qwen2-VL's. Images only: loongforge
does not train this family on videos yet (no video block, so a video sample is rejected and counted)."""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models.family import ChatFormat
from loongforge.models.qwen_vl.chatml import CHATML_VISION, QWEN2_SYSTEM_PROMPT, chatml_vision_template

CHAT = replace(CHATML_VISION, video_block="", video_rule=None,
               jinja_template=chatml_vision_template(CHATML_VISION.image_block, "", QWEN2_SYSTEM_PROMPT))


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    return CHAT
