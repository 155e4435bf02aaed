"""Qwen2-VL / Qwen2.5-VL chat format: ChatML with vision blocks (``models.qwen_vl.chatml``), the processor
facts of this family. Each image is one ``<|image_pad|>`` in the text, expanded after tokenizing to
``grid_t*grid_h*grid_w / merge**2`` copies (one per merged patch group), the processor's rule."""

from __future__ import annotations

from loongforge.models.qwen_vl.chatml import CHATML_VISION as CHAT  # noqa: F401  (the family's one format)
from loongforge.models.qwen_vl.chatml import chatml_vision as chat_format  # noqa: F401  (ModelFamily.chat)
