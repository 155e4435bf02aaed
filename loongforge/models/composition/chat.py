"""A composition's chat format: ChatML with Qwen's vision blocks (``models.qwen_vl.chatml``), no default system
turn; a videos block only where the tower's processing takes videos (the Qwen towers). Its tokenizer
(``data.tokenizer``: Qwen's offline builds, or any HF tokenizer folder) must hold ChatML's markers and the
vision tokens at ``model.tokens``' ids, which training checks before it starts.
"""

from __future__ import annotations

from dataclasses import replace

from loongforge.config.schema import ModelConfig
from loongforge.models import parts
from loongforge.models.qwen_vl.chatml import CHATML_VISION, chatml_vision_template
from loongforge.models.family import ChatFormat

_IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"


def chat_format(model_cfg: ModelConfig) -> ChatFormat:
    videos = _VIDEO_BLOCK if parts.tower(model_cfg.vision.arch).takes_videos else ""
    return replace(CHATML_VISION, video_block=videos, video_rule=CHATML_VISION.video_rule if videos else None,
                   default_system_prompt=None,
                   jinja_template=chatml_vision_template(_IMAGE_BLOCK, videos, None))
