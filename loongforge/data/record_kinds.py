"""Record kinds other than conversations: pretraining text, Alpaca instructions, image captions.

A record's kind is ``data.record_kind`` when set, else recognised by its fields, first match wins:

1. ``conversations`` or ``messages``            -> ``conversation`` (``loongforge.data.conversations``)
2. ``instruction`` and ``output``               -> ``alpaca``
3. ``caption`` (with ``image``)                 -> ``caption``
4. ``text``                                     -> ``text``

So a record holding both ``messages`` and ``text`` (chat data with a rendered copy) trains as a
conversation. Lines of a ``.txt`` file are always ``text`` records, one document per non-empty line
(LLaMA-Factory's ``wiki_demo.txt`` holds one article per line).

- ``text``: a document trained on every token, without a chat template (``TextSample``).
- ``alpaca``: ``instruction``, optional ``input`` (appended after a newline when not empty),
  ``output``, optional ``system`` and ``history`` (``[[question, answer], ...]`` before it): a chat,
  trained on its answers like any conversation.
- ``caption``: ``image`` and ``caption``: a user turn holding the image (then ``data.caption_prompt``
  when set) answered by the caption, trained on the caption.

A COCO captions file (``{"images": [...], "annotations": [...]}``) reads as one caption record per
annotation (``coco_caption_records``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from loongforge.data.template import IMAGE_PLACEHOLDER, Turn

# "preference": every record is a chosen/rejected pair (``conversations.preference_sample``); what a run
# with ``preference.loss`` set reads, never recognised by "auto" (a pair's prompt alone is a conversation
# that ends with a user turn).
RECORD_KINDS = ("auto", "conversation", "text", "alpaca", "caption", "preference")


class RecordError(Exception):
    """A record that cannot become a sample; ``reason`` is one of ``samples.REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RecordReading:
    """How records become samples: ``kind`` (``data.record_kind``: one of RECORD_KINDS) and the
    user text of caption records (``data.caption_prompt``; None: the image alone)."""

    kind: str = "auto"
    caption_prompt: Optional[str] = None

    def __post_init__(self):
        if self.kind not in RECORD_KINDS:
            raise ValueError(f"record kind {self.kind!r} is not one of {', '.join(RECORD_KINDS)}")


def reading_for(data_cfg, *, pairs: bool = False) -> RecordReading:
    """The RecordReading a run's ``DataConfig`` asks for; ``pairs``: preference training's (every record
    a chosen/rejected pair)."""
    if pairs:
        return PREFERENCE_READING
    return RecordReading(kind=data_cfg.record_kind, caption_prompt=data_cfg.caption_prompt)


TEXT_FILE_READING = RecordReading(kind="text")  # how lines of a .txt file read, whatever data.record_kind says
PREFERENCE_READING = RecordReading(kind="preference")


def record_kind(record: Any, reading: RecordReading) -> str:
    """The kind ``record`` is read as: ``reading.kind``, or for ``auto`` the first kind whose
    fields it has (module docstring); a RecordError when it has none of them."""
    if not isinstance(record, dict):
        raise RecordError("malformed_json", f"record is a {type(record).__name__}, not an object")
    if reading.kind != "auto":
        return reading.kind
    if "conversations" in record or "messages" in record:
        return "conversation"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "caption" in record:
        return "caption"
    if "text" in record:
        return "text"
    fields = ", ".join(sorted(map(str, record))[:6]) or "none"
    raise RecordError("malformed_json", f"no fields of a known record kind (conversations/messages, "
                                        f"instruction+output, image+caption, text); it has: {fields}")


def document_text(record: dict) -> str:
    """The ``text`` of a pretraining record; a blank document is a reject (nothing to train on)."""
    text = record.get("text")
    if not isinstance(text, str):
        raise RecordError("malformed_json", f"'text' is {type(text).__name__}, not a string")
    if not text.strip():
        raise RecordError("empty_answer", "'text' is empty")
    return text


def alpaca_turns(record: dict) -> list[Turn]:
    """system?, (user, assistant) per history pair, then user = instruction [+ "\\n" + input],
    assistant = output."""
    instruction, given, output = (_string_field(record, key) for key in ("instruction", "input", "output"))
    system = _string_field(record, "system")
    turns = [Turn("system", system)] if system else []
    for pair in _history(record):
        turns += [Turn("user", pair[0]), Turn("assistant", pair[1])]
    question = f"{instruction}\n{given}" if given else instruction
    if not question.strip():
        raise RecordError("malformed_json", "'instruction' and 'input' are both empty")
    return turns + [Turn("user", question), Turn("assistant", output)]


def _string_field(record: dict, key: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError("malformed_json", f"'{key}' is {type(value).__name__}, not a string")
    return value


def _history(record: dict) -> list[tuple[str, str]]:
    history = record.get("history") or []
    if not isinstance(history, list):
        raise RecordError("malformed_json", f"'history' is {type(history).__name__}, not a list")
    pairs = []
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise RecordError("malformed_json", f"history entry {index} is not a [question, answer] pair")
        pairs.append((pair[0], pair[1]))
    return pairs


def caption_turns(record: dict, prompt: Optional[str]) -> tuple[list[Turn], Any]:
    """(user turn = the image, then ``prompt`` if any; assistant turn = the caption), and the
    record's image entry (resolved by the caller, like a conversation's)."""
    caption = _string_field(record, "caption")
    image = record.get("image", record.get("images"))
    if isinstance(image, list) and len(image) == 1:
        image = image[0]
    if image is None or isinstance(image, list):
        raise RecordError("malformed_json", "a caption record needs one 'image'")
    user = f"{IMAGE_PLACEHOLDER}{prompt}" if prompt else IMAGE_PLACEHOLDER  # image first, as Qwen's demos write it
    return [Turn("user", user), Turn("assistant", caption)], image


# ---------------------------------------------------------------- COCO captions files


def is_coco_captions(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("images"), list) and isinstance(
        value.get("annotations"), list)


def coco_caption_records(coco: dict, file_name: str) -> list[dict]:
    """One ``{"image", "caption"}`` record per annotation, in the file's order. Images are named
    ``<split>/<file_name>`` for a file named ``captions_<split>.json`` (COCO's layout: the
    ``val2017/`` folder beside ``captions_val2017.json``), else by their file name; relative paths
    resolve against the file's folder as in any record. An annotation whose image id is not listed
    keeps ``image`` null and becomes a malformed_json reject."""
    split = re.fullmatch(r"captions_(\w+)\.json", file_name)
    folder = f"{split.group(1)}/" if split else ""
    names = {image.get("id"): image.get("file_name") for image in coco["images"] if isinstance(image, dict)}
    records = []
    for annotation in coco["annotations"]:
        if not isinstance(annotation, dict):
            records.append({"caption": None, "image": None})
            continue
        name = names.get(annotation.get("image_id"))
        records.append({"image": f"{folder}{name}" if isinstance(name, str) else None,
                        "caption": annotation.get("caption"), "coco_id": annotation.get("id")})
    return records
