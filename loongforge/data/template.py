"""Chat rendering: render a conversation in its model's format, tokenize it, mark answers.

The format's text (turn markers, vision blocks, the Jinja twin for ``apply_chat_template``) is the
model's ``ChatFormat`` (``ModelFamily.chat(model_cfg)``). Qwen's is ChatML (with vision blocks in
Qwen2.5-VL)::

    {turn_start}system\\n{system prompt}{turn_end}\\n
    {turn_start}user\\n{image_block}Who is he?{turn_end}\\n
    {turn_start}assistant\\nHe's Thomas Muller.{turn_end}\\n

Llama 3's opens the text with ``<|begin_of_text|>``, ends the role with
``<|end_header_id|>\\n\\n`` and puts nothing between turns. A conversation without a leading system
turn gets ``data.system_prompt``, or when that is unset the model's own default (Qwen2.5's "You are a
helpful assistant."; none for Qwen3 and Qwen3-VL); ``""`` means no system turn. Qwen3's thinking
format writes the reasoning of an assistant turn after the last user turn as
``<think>\\n{reasoning}\\n</think>\\n\\n`` before its answer (empty in the last turn when the data
has none) and drops the reasoning of earlier turns, as its template does (Qwen3.5's versions: other
turns, ``ChatFormat.reasoning_turns``; Qwen3.8's opens the system turn with ``system_preamble``). Each
image is one pad token in the text; after tokenization it is expanded to the image's LLM token count
(one per merged patch group), the processor's rule. Labels: the answer tokens of each assistant turn (with its
reasoning block) and its ``turn_end``; not the role header, not what separates turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from loongforge.models.family import THINK_CLOSE, THINK_OPEN, ChatFormat

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


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


def render_chat(turns: list[Turn], system_prompt: str | None, chat: ChatFormat) -> RenderedChat:
    """Render in the model's format; labels span each answer and its ``turn_end``.

    ``system_prompt`` (``data.system_prompt``) is written when the conversation has no system turn:
    None means the format's ``default_system_prompt``, ``""`` none."""
    system = chat.default_system_prompt if system_prompt is None else system_prompt
    last_user = max((i for i, turn in enumerate(turns) if turn.role == "user"), default=-1)
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0

    def emit(piece: str) -> None:
        nonlocal length
        pieces.append(piece)
        length += len(piece)

    emit(chat.text_start)
    images = _ImageCount()
    previous = ""
    if turns and turns[0].role != "system" and (system or chat.system_preamble):
        emit(f"{chat.header('system')}{turn_content(system_text(system or '', chat), chat, images)}"
             f"{chat.end('system')}{chat.turn_sep}")
        previous = "system"
    for index, turn in enumerate(turns):
        text = turn.text.strip() if chat.strips_turns else turn.text
        if index == 0 and turn.role == "system":
            text = system_text(text, chat)
            if not text and chat.system_preamble is not None:
                continue  # a template that builds the system turn writes none when it has no text
        emit(chat.header(turn.role, previous))
        previous = turn.role
        start = length
        if chat.thinking and turn.role == "assistant":
            mode = chat.reasoning_turns
            even_empty = mode in ("after_last_user", "all") or (mode == "last" and index == len(turns) - 1)
            text = with_reasoning_block(text, keep=mode == "all" or index > last_user, even_empty=even_empty,
                                        trim=chat.strips_turns, strip_answer=mode == "some_after_last_user")
        emit(turn_content(text, chat, images) + chat.end(turn.role))
        if turn.role == "assistant":
            spans.append((start, length))
        emit(chat.turn_sep)
    return RenderedChat(text="".join(pieces), label_spans=spans)


def system_text(text: str, chat: ChatFormat) -> str:
    """A system turn's text as the format writes it (stripped where the format strips turns): after the
    format's ``system_preamble`` and a blank line, the preamble alone when the text is empty."""
    text = text.strip() if chat.strips_turns else text
    if not chat.system_preamble:
        return text
    return f"{chat.system_preamble}\n\n{text}" if text else chat.system_preamble


def with_reasoning_block(text: str, *, keep: bool, even_empty: bool, trim: bool = False,
                         strip_answer: bool = False) -> str:
    """An assistant turn as a thinking template writes it: reasoning (``<think>...</think>`` in the data,
    possibly without the opening tag) split from the answer, then either written back in a normalised
    block (``keep``, and the data has reasoning or ``even_empty``) or dropped. ``trim``: the reasoning is
    stripped of all surrounding whitespace (the template's ``trim``), not only of newlines. ``strip_answer``:
    an answer split from its reasoning loses its trailing newlines too (MiniMax-M2's ``strip('\\n')``)."""
    reasoning, answer = "", text
    if THINK_CLOSE in text:
        before, answer = text.split(THINK_CLOSE, 1)[0], text.split(THINK_CLOSE)[-1]
        answer = answer.strip("\n") if strip_answer else answer.lstrip("\n")
        reasoning = before.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    if keep and (even_empty or reasoning):
        reasoning, answer = (reasoning.strip() if trim else reasoning.strip("\n")), answer.lstrip("\n")
        return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}"
    return answer


class _ImageCount:
    """The images a conversation's turns have written so far (``ChatFormat.image_label`` numbers them)."""

    def __init__(self) -> None:
        self.written = 0

    def block(self, chat: ChatFormat) -> str:
        """The next image's block, after its label where the format writes one."""
        self.written += 1
        return chat.image_label.format(index=self.written) + chat.image_block


def turn_content(text: str, chat: ChatFormat, images: Optional[_ImageCount] = None) -> str:
    """A turn's text as the format writes it: media blocks where the placeholders stand, or
    (``ChatFormat.media_first``) the images' blocks, the videos', then each text piece after a newline.
    ``images``: the conversation's count so far, where the format labels each image by its number."""
    images = images or _ImageCount()
    pieces = list(_split_placeholders(text))
    if chat.media_first:
        blocks = [images.block(chat) for _, kind in pieces if kind == "image"]
        videos = sum(kind == "video" for _, kind in pieces)
        texts = "".join("\n" + chunk for chunk, kind in pieces if kind == "text" and chunk)
        return "".join(blocks) + chat.video_block * videos + texts
    return "".join(chunk if kind == "text" else images.block(chat) if kind == "image" else chat.video_block
                   for chunk, kind in pieces)


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


def replace_media_tokens(input_ids: np.ndarray, is_answer: np.ndarray, pad_token_id: int,
                         replacements: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Replace the i-th ``pad_token_id`` by the ids ``replacements[i]`` (an image's wrapped pads, a
    video's timestamped blocks); inserted tokens are not answers."""
    positions = np.flatnonzero(input_ids == pad_token_id)
    if len(positions) != len(replacements):
        raise ValueError(f"{len(positions)} pad tokens {pad_token_id} in text but {len(replacements)} media items")
    ids, answer, start = [], [], 0
    for position, replacement in zip(positions, replacements):
        ids += [input_ids[start:position], replacement]
        answer += [is_answer[start:position], np.zeros(len(replacement), dtype=bool)]
        start = position + 1
    ids.append(input_ids[start:])
    answer.append(is_answer[start:])
    return np.concatenate(ids).astype(np.int64), np.concatenate(answer)
