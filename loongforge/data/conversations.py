"""Read LLaVA / ShareGPT / OpenAI-style conversation files into ConversationSample records.

Accepted layouts (one record per conversation):

- ``{"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}], "image": "a.jpg"}``
- ``{"messages": [{"role": "user"|"assistant"|"system", "content": "<image>..."}], "images": [...]}``
- content as a list of parts, ``[{"type": "image_url", "value": "a.jpg"}, {"type": "text", ...}]``
  (LLaMA-Factory v1); each media part becomes a placeholder at its position.

Files: JSON (a list, read element by element so each record keeps its line), JSONL, parquet
(images may be ``{"bytes": ..., "path": ...}`` dicts). A sample is named by its file and its
record's ordinal there (``samples.sample_id_of``), never by its line: the records of a JSON list
written on one line, or of a COCO captions file, all start on one line. Relative media paths
resolve against the data file's folder. LLaMA-Factory writes them relative to its repo root
(``data/x.jpg`` for a file living in ``data/``); when the plain join does not exist, leading
folders of the relative path are dropped one by one until one exists.

Other record kinds (pretraining ``text``, Alpaca, image-caption pairs, COCO captions files, ``.txt``
files of one document per non-empty line) are recognised by their fields or set by
``data.record_kind`` (``loongforge.data.record_kinds``); ``parse_record`` reads them all. A run with
``preference.loss`` set reads every record as a chosen/rejected pair (``preference_fields``,
``loongforge.data.preference``).

``FileSamples.get(i)`` never raises for bad data: it returns a ``Reject`` instead.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from loongforge.config.errors import InputError
from loongforge.data.mixture import entry_path, entry_weights
from loongforge.data.record_kinds import (
    TEXT_FILE_READING,
    RecordError,
    RecordReading,
    alpaca_turns,
    caption_turns,
    coco_caption_records,
    document_text,
    is_coco_captions,
    record_kind,
)
from loongforge.data.samples import ConversationSample, PreferenceSample, Reject, Sample, TextSample, sample_id_of
from loongforge.data.template import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Turn
from loongforge.data.vision import path_exists

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
_IMAGE_PART_TYPES = {"image", "image_url"}
_VIDEO_PART_TYPES = {"video", "video_url"}
# What a folder in data.paths contributes. Not .txt: a README or notes beside the data would become
# training text unnoticed; a .txt corpus is named file by file.
DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
_PATHS_REMEDY = "pass .json/.jsonl/.parquet/.txt files, or folders holding .json/.jsonl/.parquet files"
DEFAULT_READING = RecordReading()


# ---------------------------------------------------------------- record -> sample


def parse_record(record: Any, *, file: str, line: int, ordinal: int, media_root: Path,
                 reading: RecordReading = DEFAULT_READING) -> Union[Sample, Reject]:
    """Validate one decoded record of the kind ``reading`` gives it (``record_kinds.record_kind``);
    a Reject names the first problem found. ``line``: where the record starts (for people);
    ``ordinal``: its position in its file (``_Located.ordinal``), what names it."""
    where = {"file": file, "line": line, "record": ordinal}
    try:
        kind = record_kind(record, reading)
        if kind == "text":
            return TextSample(sample_id=sample_id_of(file, ordinal), text=document_text(record), **where)
        if kind == "preference":
            return PreferenceSample(sample_id=sample_id_of(file, ordinal), **preference_fields(record, media_root),
                                    **where)
        turns, images, videos = _kind_turns(record, kind, media_root, reading)
        _check_roles(turns)
        _check_answers(turns)
        _check_media_counts(turns, len(images), len(videos))
    except RecordError as error:
        return Reject(reason=error.reason, detail=error.detail, **where)
    return ConversationSample(sample_id=sample_id_of(file, ordinal), turns=turns, images=images, videos=videos, **where)


def preference_fields(record: dict, media_root: Path) -> dict:
    """``PreferenceSample``'s prompt, answers and media from a LLaMA-Factory ranking record
    (``conversations``/``messages`` + ``chosen`` + ``rejected``) or a ``prompt``/``chosen``/``rejected``
    one (``data.preference``); each side checked as a conversation. RecordError on the first problem."""
    if "chosen" not in record or "rejected" not in record:
        fields = ", ".join(sorted(map(str, record))[:6]) or "none"
        raise RecordError("malformed_json", f"a preference pair needs 'chosen' and 'rejected'; it has: {fields}")
    if "prompt" in record and not ("conversations" in record or "messages" in record):
        prompt = record["prompt"]
        if isinstance(prompt, str):
            turns, inline_images, inline_videos = [Turn("user", prompt)], [], []
        else:
            turns, inline_images, inline_videos = _parse_turns({"messages": prompt})
    else:
        turns, inline_images, inline_videos = _parse_turns(record)
    system = record.get("system")
    if isinstance(system, str) and system and turns[0].role != "system":
        turns = [Turn("system", system), *turns]
    answers = {side: _answer_text(record[side], side) for side in ("chosen", "rejected")}
    images = _media_list(record, ("images", "image"), inline_images, media_root)
    videos = _media_list(record, ("videos", "video"), inline_videos, media_root)
    for answer in answers.values():
        side = [*turns, Turn("assistant", answer)]
        _check_roles(side)
        _check_answers(side)
        _check_media_counts(side, len(images), len(videos))
    return {"prompt": turns, **answers, "images": images, "videos": videos}


def _answer_text(value: Any, side: str) -> str:
    """One side's answer: a string, one assistant message, or a list of exactly one."""
    if isinstance(value, list):
        if len(value) != 1:
            raise RecordError("malformed_json", f"'{side}' holds {len(value)} messages, not one assistant answer")
        value = value[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise RecordError("malformed_json", f"'{side}' is {type(value).__name__}, not a message or a string")
    raw_role = value.get("from", value.get("role", "assistant"))
    if ROLE_ALIASES.get(raw_role) != "assistant":
        raise RecordError("bad_roles", f"'{side}' is a {raw_role!r} message, not the assistant's")
    text = _content_text(value.get("value", value.get("content")), 0, [], [])
    if IMAGE_PLACEHOLDER in text or VIDEO_PLACEHOLDER in text:
        raise RecordError("media_mismatch", f"'{side}' holds an image or video; media go in the prompt")
    return text


def _kind_turns(record: dict, kind: str, media_root: Path, reading: RecordReading) -> tuple[list[Turn], list, list]:
    """(turns, images, videos) of a conversation, Alpaca or caption record."""
    if kind == "alpaca":
        return alpaca_turns(record), [], []
    if kind == "caption":
        turns, image = caption_turns(record, reading.caption_prompt)
        return turns, [_resolve_media(image, media_root)], []
    turns, inline_images, inline_videos = _parse_turns(record)
    images = _media_list(record, ("images", "image"), inline_images, media_root)
    videos = _media_list(record, ("videos", "video"), inline_videos, media_root)
    return turns, images, videos


def read_record(record: Any, error: Optional[str], *, file: str, line: int, ordinal: int, media_root: Path,
                reading: RecordReading = DEFAULT_READING) -> Union[Sample, Reject]:
    """A decoded record, or the reason it could not be decoded (a malformed_json reject)."""
    if error is not None:
        return Reject(file=file, line=line, reason="malformed_json", detail=error, record=ordinal)
    return parse_record(record, file=file, line=line, media_root=media_root, ordinal=ordinal, reading=reading)


def read_json_record(raw: bytes, *, file: str, line: int, ordinal: int, media_root: Path,
                     reading: RecordReading = DEFAULT_READING) -> Union[Sample, Reject]:
    """One record's JSON text (a JSON line, undecoded until now) as ``read_record`` takes it."""
    try:
        record, error = json.loads(raw), None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        record, error = None, str(exc)
    return read_record(record, error, file=file, line=line, media_root=media_root, ordinal=ordinal, reading=reading)


def reading_of(path: Path, reading: RecordReading) -> RecordReading:
    """How the records of data file ``path`` read: a ``.txt`` file's lines are documents whatever
    ``data.record_kind`` says; every other source follows ``reading``."""
    return TEXT_FILE_READING if path.suffix == ".txt" else reading


def _parse_turns(record: dict) -> tuple[list[Turn], list, list]:
    messages = record.get("conversations", record.get("messages"))
    if not isinstance(messages, list) or not messages:
        raise RecordError("malformed_json", "no non-empty 'conversations' or 'messages' list")
    turns, images, videos = [], [], []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError("malformed_json", f"message {index} is not an object")
        raw_role = message.get("from", message.get("role"))
        role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise RecordError("bad_roles", f"message {index} has unknown role {raw_role!r}")
        content = message.get("value", message.get("content"))
        turns.append(Turn(role=role, text=_content_text(content, index, images, videos)))
    return turns, images, videos


def _content_text(content: Any, index: int, images: list, videos: list) -> str:
    """A string content as is; a list of parts flattened, media parts becoming placeholders."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordError("malformed_json", f"message {index} content is {type(content).__name__}")
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
            continue
        if not isinstance(part, dict):
            raise RecordError("malformed_json", f"message {index} has a non-object content part")
        kind = part.get("type", "text")
        value = next((part[k] for k in ("value", "text", "url", kind) if k in part), None)
        if isinstance(value, dict):  # OpenAI style {"image_url": {"url": ...}}
            value = value.get("url")
        if kind in _IMAGE_PART_TYPES:
            pieces.append(IMAGE_PLACEHOLDER)
            images.append(value)
        elif kind in _VIDEO_PART_TYPES:
            pieces.append(VIDEO_PLACEHOLDER)
            videos.append(value)
        elif kind == "text" and isinstance(value, str):
            pieces.append(value)
        else:
            raise RecordError("malformed_json", f"message {index} has an unusable part of type {kind!r}")
    return "".join(pieces)


def _media_list(record: dict, keys: tuple[str, str], inline: list, media_root: Path) -> list:
    listed = next((record[k] for k in keys if record.get(k) is not None), None)
    if listed is None:
        listed = []
    elif not isinstance(listed, list):
        listed = [listed]
    if inline and listed:
        raise RecordError("media_mismatch", f"media both inline in messages and in '{keys[0]}'")
    return [_resolve_media(item, media_root) for item in (inline or listed)]


def _resolve_media(item: Any, media_root: Path):
    if isinstance(item, dict):  # parquet / HF datasets Image feature
        if item.get("bytes"):
            return bytes(item["bytes"])
        item = item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if not isinstance(item, str) or not item:
        raise RecordError("malformed_json", f"media entry {item!r} is not a path")
    return str(resolve_media_path(item, media_root))


def resolve_media_path(path: str, media_root: Path) -> Path:
    candidate = Path(path)
    if candidate.is_absolute():
        return candidate
    direct = media_root / candidate
    if path_exists(direct):
        return direct
    parts = candidate.parts
    for skip in range(1, len(parts)):
        shorter = media_root.joinpath(*parts[skip:])
        if path_exists(shorter):
            return shorter
    return direct  # does not exist: reported as missing_image when measured


def _check_roles(turns: list[Turn]) -> None:
    body = turns[1:] if turns[0].role == "system" else turns
    if not body:
        raise RecordError("bad_roles", "no user/assistant turns")
    for index, turn in enumerate(body):
        expected = "user" if index % 2 == 0 else "assistant"
        if turn.role != expected:
            raise RecordError("bad_roles", f"turn {index} is {turn.role!r}, expected {expected!r}")
    if body[-1].role != "assistant":
        raise RecordError("bad_roles", "conversation ends with a user turn")


def _check_answers(turns: list[Turn]) -> None:
    for index, turn in enumerate(turns):
        if turn.role == "assistant" and not turn.text.strip():
            raise RecordError("empty_answer", f"assistant turn {index} is empty")


def _check_media_counts(turns: list[Turn], num_images: int, num_videos: int) -> None:
    image_slots = sum(turn.text.count(IMAGE_PLACEHOLDER) for turn in turns)
    video_slots = sum(turn.text.count(VIDEO_PLACEHOLDER) for turn in turns)
    if image_slots != num_images or video_slots != num_videos:
        raise RecordError(
            "media_mismatch",
            f"{image_slots} <image> for {num_images} images, {video_slots} <video> for {num_videos} videos",
        )


# ---------------------------------------------------------------- files -> located records


@dataclass(frozen=True)
class _Located:
    """A raw record (or the reason it could not be decoded), the line it starts at and its ordinal:
    its 0-based position in its file, unique there and the same in every reader (``ArrowSamples``,
    ``StreamingSamples``). In a file of one record per line (JSON lines, ``.txt``) it is the line - 1,
    blank lines counted, so that a reader streaming the file knows it without counting records; in
    a JSON list or a COCO captions file, the element's index; in a table, the row."""

    line: int
    ordinal: int
    record: Any = None
    error: str | None = None


class _LineIndex:
    """Character offset -> 1-based line number."""

    def __init__(self, text: str):
        self._newlines = [m.start() for m in re.finditer("\n", text)]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_left(self._newlines, offset) + 1


def read_json_array(text: str) -> list[_Located]:
    """Decode a JSON list element by element so each keeps its line. A broken element becomes one
    error entry; reading resumes at the next line indented like the first element (pretty-printed
    files), else the rest of the file is reported as unreadable in that entry."""
    decoder = json.JSONDecoder()
    lines = _LineIndex(text)
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        return [_Located(line=lines.line_of(pos), ordinal=0, error="file is not a JSON list")]
    pos = _skip_ws(text, pos + 1)
    element_indent = _indent_at(text, pos)
    located: list[_Located] = []
    while pos < len(text) and text[pos] != "]":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            resume = _resync(text, pos + 1, element_indent)
            note = "" if resume is not None else "; rest of file unreadable"
            located.append(_Located(line=lines.line_of(pos), ordinal=len(located),
                                    error=f"{error.msg} at line {error.lineno}{note}"))
            if resume is None:
                break
            pos = resume
            continue
        located.append(_Located(line=lines.line_of(pos), ordinal=len(located), record=record))
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            located.append(_Located(line=lines.line_of(pos), ordinal=len(located),
                                    error="expected ',' or ']' after element"))
            break
    return located


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _indent_at(text: str, pos: int) -> str | None:
    line_start = text.rfind("\n", 0, pos) + 1
    prefix = text[line_start:pos]
    return prefix if line_start > 0 and prefix.strip() == "" else None


def _resync(text: str, search_from: int, indent: str | None) -> int | None:
    # Search from the broken element's start: the decoder may have failed inside the next one.
    if indent is None:
        return None
    match = re.compile(r"\n" + re.escape(indent) + r"\{").search(text, search_from)
    return match.start() + 1 + len(indent) if match else None


def read_jsonl(path: Path) -> list[_Located]:
    located = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                located.append(_Located(line=number, ordinal=number - 1, record=json.loads(raw)))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                located.append(_Located(line=number, ordinal=number - 1, error=str(error)))
    return located


def read_parquet(path: Path) -> list[_Located]:
    import pyarrow.parquet as pq  # lazy: pyarrow only for .parquet files

    table = pq.read_table(path)
    return [_Located(line=row + 1, ordinal=row, record=record) for row, record in enumerate(table.to_pylist())]


def read_text_documents(path: Path) -> list[_Located]:
    """A ``.txt`` file: one ``{"text": line}`` record per non-empty line (its line ending dropped)."""
    located = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            located.extend(text_line_record(number, raw))
    return located


def text_line_record(number: int, raw: bytes) -> list[_Located]:
    """Line ``number`` (1-based) of a ``.txt`` file as its record (none for a blank line)."""
    if not raw.strip():
        return []
    try:
        return [_Located(line=number, ordinal=number - 1, record={"text": raw.decode("utf-8").rstrip("\r\n")})]
    except UnicodeDecodeError as error:
        return [_Located(line=number, ordinal=number - 1, error=f"not UTF-8: {error}")]


def read_data_file(path: Path) -> list[_Located]:
    if path.suffix == ".parquet":
        return read_parquet(path)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".txt":
        return read_text_documents(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        return [_Located(line=1, ordinal=0, error=f"not UTF-8: {error}")]
    if text.lstrip().startswith("{"):  # JSON lines saved as .json, or one object such as COCO's
        return _coco_records(text, path) or read_jsonl(path)
    return read_json_array(text)


def _coco_records(text: str, path: Path) -> Optional[list[_Located]]:
    """The caption records of a COCO captions file (all on the line its annotations start), or
    None when ``text`` is not one JSON object of COCO's layout."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:  # JSON lines ("Extra data" after the first object)
        return None
    if not is_coco_captions(whole):
        return None
    line = _LineIndex(text).line_of(text.find('"annotations"'))
    return [_Located(line=line, ordinal=ordinal, record=record)
            for ordinal, record in enumerate(coco_caption_records(whole, path.name))]


HUB_PREFIX = "hf:"  # data.paths entry naming a dataset in the local Hugging Face cache


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk``."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _saved_dataset_splits(path: Path) -> Optional[list[str]]:
    """The split names of a ``DatasetDict.save_to_disk`` folder, else None."""
    listing = path / "dataset_dict.json"
    if not listing.is_file():
        return None
    return json.loads(listing.read_text(encoding="utf-8")).get("splits", [])


def expand_data_paths(paths: list, key: str = "data.paths") -> list[str]:
    """The data sources of ``data.paths``, in a stable order: files as given; folders expand to
    their data files, sorted, a ``save_to_disk`` folder among them staying one source; ``hf:NAME``
    entries as given.

    The one check that data paths can be read at all (``pack`` and ``train`` both call it before
    any work starts): a missing entry, an empty file, or nothing to read is an InputError naming
    ``key``, the config key the paths came from. Entries may carry a mixture weight (``path@weight``,
    ``loongforge.data.mixture``): checked here, then the path is read.
    """
    entry_weights(list(paths))  # a bad or missing weight is one line before anything is read
    sources: list[str] = []
    for entry in map(entry_path, paths):  # paths or strings
        path = Path(entry)
        if entry.startswith(HUB_PREFIX):
            sources.append(entry)
        elif path.is_dir():
            sources.extend(str(p) for p in _folder_sources(path, entry))
        elif path.is_file():
            sources.append(str(path))
        else:
            raise InputError(f"{key} entry {entry!r} does not exist; {_PATHS_REMEDY}")
    if not sources:
        raise InputError(f"{key} {paths!r} holds no .json/.jsonl/.parquet files; {_PATHS_REMEDY}")
    empty = [s for s in sources if Path(s).is_file() and Path(s).stat().st_size == 0]
    if empty:
        raise InputError(f"{key} file {empty[0]} is empty"
                         f"{f' (and {len(empty) - 1} more)' if len(empty) > 1 else ''}; {_PATHS_REMEDY}")
    return sources


def entry_groups(paths: list) -> list[range]:
    """The sources (indices into ``expand_data_paths(paths)``) of each data.paths entry; empty for
    an entry with nothing to read (the whole list is checked by ``expand_data_paths``)."""
    groups, first = [], 0
    for entry in paths:
        try:
            count = len(expand_data_paths([entry]))
        except InputError:
            count = 0
        groups.append(range(first, first + count))
        first += count
    return groups


def _folder_sources(folder: Path, entry: str) -> list[Path]:
    splits = _saved_dataset_splits(folder)
    if splits is not None:
        raise InputError(f"data.paths entry {entry!r} holds the splits {', '.join(splits)} of a saved dataset; "
                         f"name the one to train on, e.g. {str(folder / splits[0])!r}" if splits else
                         f"data.paths entry {entry!r} is a saved DatasetDict without splits")
    if is_saved_dataset(folder):
        return [folder]
    saved = sorted(p.parent for p in folder.rglob("state.json") if is_saved_dataset(p.parent))
    files = [p for p in folder.rglob("*") if p.suffix in DATA_FILE_SUFFIXES and p.is_file()
             and not any(p.is_relative_to(d) for d in saved)]
    return sorted(files + saved)


class FileSamples:
    """All records of the data files, indexable in a fixed order (files in order, records in
    file order), decoded up front into Python objects (metadata only, no media); ``get`` validates
    lazily and returns a sample or a Reject.

    The in-memory reader: it defines the samples, order and rejects that
    ``loongforge.data.arrow_samples.ArrowSamples`` (what runs read) reproduces without holding
    the records, and is the baseline of ``loongforge bench data``. Memory grows with the data."""

    def __init__(self, paths: list[str], reading: RecordReading = DEFAULT_READING):
        self._reading = reading
        self._entries: list[tuple[Path, _Located]] = []
        for source in expand_data_paths(paths):
            path = Path(source)
            if not path.is_file():
                raise InputError(f"{source}: the in-memory reader takes data files only")
            self._entries.extend((path, entry) for entry in read_data_file(path))

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, index: int) -> Union[Sample, Reject]:
        path, located = self._entries[index]
        return read_record(located.record, located.error, file=str(path), line=located.line, ordinal=located.ordinal,
                           media_root=path.parent, reading=reading_of(path, self._reading))
