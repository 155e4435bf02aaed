"""LLaVA-OneVision-1.5's chat format: Qwen2-VL's (``models.qwen_vl.chatml``; its processor is Qwen2-VL's image
and video processors with Qwen's tokenizer): ChatML where an image is ``<|vision_start|><|image_pad|><|vision_end|>``
and a video ``<|vision_start|><|video_pad|><|vision_end|>``, each pad expanded after tokenizing to
``t * h * w / merge^2`` copies (a video's frames one temporal patch each: RICE-ViT embeds every frame on its own,
with a class token), and Qwen2-VL's default system turn."""

from __future__ import annotations

from loongforge.models.qwen_vl.chatml import CHATML_VISION as CHAT  # noqa: F401  (the family's one format)
from loongforge.models.qwen_vl.chatml import chatml_vision as chat_format  # noqa: F401  (ModelFamily.chat)
