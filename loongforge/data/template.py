"""Qwen2-VL / Qwen2.5-VL chat format: render a conversation, tokenize it, mark answer tokens.

The format (ChatML with vision markers)::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Who is he?<|im_end|>\\n
    <|im_start|>assistant\\nHe's Thomas Muller.<|im_end|>\\n

A conversation without a leading system turn gets the default system prompt. Each image is one
``<|image_pad|>`` in the text; after tokenization it is expanded to ``grid_t*grid_h*grid_w / 4``
copies (one per merged 2x2 patch group), the processor's rule. Labels: the answer tokens of each
assistant turn and its ``<|im_end|>``; not the role header, not the trailing newline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Jinja rendering of the same format for `tokenizer.apply_chat_template`; messages use HF's
# content-part form ({"type": "image"} / {"type": "video"} / {"type": "text", "text": ...}).
# No whitespace control: HF renders with trim_blocks, and no newline here follows a block tag.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Turn:
    """One message; ``text`` keeps ``<image>``/``<video>`` placeholders where media go."""

    role: str  # "system" | "user" | "assistant"
    text: str


@dataclass
class RenderedChat:
    """Rendered text plus the character spans whose tokens are trained on."""

    text: str
    label_spans: list[tuple[int, int]]  # [start, end) character offsets into text


def render_chat(turns: list[Turn], default_system_prompt: str | None) -> RenderedChat:
    """Render in Qwen's format; labels span each answer and its ``<|im_end|>``."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0

    def emit(piece: str) -> None:
        nonlocal length
        pieces.append(piece)
        length += len(piece)

    if turns and turns[0].role != "system" and default_system_prompt is not None:
        emit(f"{IM_START}system\n{default_system_prompt}{IM_END}\n")
    for turn in turns:
        emit(f"{IM_START}{turn.role}\n")
        start = length
        emit(expand_placeholders(turn.text) + IM_END)
        if turn.role == "assistant":
            spans.append((start, length))
        emit("\n")
    return RenderedChat(text="".join(pieces), label_spans=spans)


def expand_placeholders(text: str) -> str:
    """``<image>`` -> one vision block with a single ``<|image_pad|>`` (expanded after tokenizing)."""
    return text.replace(IMAGE_PLACEHOLDER, IMAGE_BLOCK).replace(VIDEO_PLACEHOLDER, VIDEO_BLOCK)


def turns_to_hf_messages(turns: list[Turn]) -> list[dict]:
    """Our turns as HF content-part messages, for checking against ``apply_chat_template``."""
    messages = []
    for turn in turns:
        parts = []
        for chunk, kind in _split_placeholders(turn.text):
            if kind == "text":
                if chunk:
                    parts.append({"type": "text", "text": chunk})
            else:
                parts.append({"type": kind})
        messages.append({"role": turn.role, "content": parts})
    return messages


def _split_placeholders(text: str):
    index = 0
    while index < len(text):
        image_at = text.find(IMAGE_PLACEHOLDER, index)
        video_at = text.find(VIDEO_PLACEHOLDER, index)
        hits = [(at, kind) for at, kind in ((image_at, "image"), (video_at, "video")) if at >= 0]
        if not hits:
            yield text[index:], "text"
            return
        at, kind = min(hits)
        yield text[index:at], "text"
        yield None, kind
        index = at + len(IMAGE_PLACEHOLDER if kind == "image" else VIDEO_PLACEHOLDER)


@dataclass
class TokenizedChat:
    """Token ids with one pad token per media item, and which tokens are answer tokens."""

    input_ids: np.ndarray  # int64 [L_compact]
    is_answer: np.ndarray  # bool [L_compact]


def tokenize_chat(tokenizer, chat: RenderedChat) -> TokenizedChat:
    """Tokenize the whole text once (so merges across turn boundaries match HF) and label tokens
    whose first character lies inside an answer span."""
    encoded = tokenizer(chat.text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    is_answer = np.zeros(len(ids), dtype=bool)
    for span_start, span_end in chat.label_spans:
        is_answer |= (starts >= span_start) & (starts < span_end)
    return TokenizedChat(input_ids=ids, is_answer=is_answer)


def expand_media_tokens(
    input_ids: np.ndarray, is_answer: np.ndarray, pad_token_id: int, counts: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Repeat the i-th ``pad_token_id`` ``counts[i]`` times; returns (ids, is_answer) expanded."""
    positions = np.flatnonzero(input_ids == pad_token_id)
    if len(positions) != len(counts):
        raise ValueError(f"{len(positions)} pad tokens {pad_token_id} in text but {len(counts)} media items")
    repeats = np.ones(len(input_ids), dtype=np.int64)
    repeats[positions] = counts
    return np.repeat(input_ids, repeats), np.repeat(is_answer, repeats)
