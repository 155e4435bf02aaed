"""The benchmark data sets: one reader each, and one way to size a sample.

The data root (``--data-root``, default ``$LOONGFORGE_SHARED_DATA``) is laid out as the project's
shared data folder is (its README gives provenance and licenses):

- ``coco2017/captions_val2017.json``: one "describe" chat per caption; image sizes from the json;
- ``mathvista/testmini.json``: question (+ choices) -> answer; image sizes from its metadata;
- ``arena_hard/v2.0_model_answer_o3-mini-2025-01-31.jsonl``: prompts with o3-mini answers (text);
- ``llamafactory/alpaca_en_demo.json``: short instruction -> output chats (text);
- ``omnibal/*.csv``: per-sample sizes already measured (InternVL tiles and final LLM lengths).

Readers return ``Chat`` records with the recorded width x height of each image instead of the
image, so the sets need no image files. ``SampleSizer`` sizes a chat (or a sample read from a
conversation file) through the library's own measure path, ``data.measure.SampleMeasurer``: the
chat is rendered with the preset's template, tokenized, and each image pad expanded to the tokens
the preset's resize rules give; the image is a blank stand-in of the recorded size, of which
measure reads only the size. So a benchmark's lengths are the ones ``pack`` would measure.
"""

from __future__ import annotations

import ast
import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from PIL import Image

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.template import Turn
from loongforge.data.tokenizer import load_tokenizer

DATA_ROOT_ENV = "LOONGFORGE_SHARED_DATA"
COCO_CAPTIONS = Path("coco2017/captions_val2017.json")
COCO_IMAGES = Path("coco2017/val2017")
MATHVISTA = Path("mathvista/testmini.json")
ARENA_HARD = Path("arena_hard/v2.0_model_answer_o3-mini-2025-01-31.jsonl")
ALPACA = Path("llamafactory/alpaca_en_demo.json")
OMNIBAL = Path("omnibal")
DESCRIBE_PROMPT = "<image>Describe this image in one sentence."
INTERNVL_TILE_PATCHES = (448 // 14) ** 2  # OmniBal's vit_num counts 448x448 tiles: 32x32 patches of 14 px
# Measure with no seq_len limit: benches count samples longer than their seq_len themselves.
_NO_SEQ_LIMIT = 10_000_000


def resolve_data_root(data_root: Optional[Path], required: Sequence[Path] = ()) -> Path:
    """``--data-root``, else ``$LOONGFORGE_SHARED_DATA``; InputError when neither is set or a
    ``required`` file is missing under it."""
    root = data_root or os.environ.get(DATA_ROOT_ENV)
    if not root:
        raise InputError(f"--data-root is not given and ${DATA_ROOT_ENV} is not set: pass the shared "
                         "data folder (coco2017/, mathvista/, arena_hard/, llamafactory/)")
    root = Path(root)
    for path in required:
        if not (root / path).exists():
            raise InputError(f"--data-root {root}: no {path}; point it at the shared data folder")
    return root


@dataclass
class Chat:
    question: str  # with one <image> per entry of ``image_sizes``
    answer: str
    image_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height)

    def to_sample(self, sample_id: str) -> ConversationSample:
        # A 1-bit blank image of the recorded size: measure reads only its size.
        images = [Image.new("1", (int(w), int(h))) for w, h in self.image_sizes]
        return ConversationSample(sample_id=sample_id, file=sample_id, line=0, images=images,
                                  turns=[Turn("user", self.question), Turn("assistant", self.answer)])


@dataclass(frozen=True)
class SampleSize:
    tokens: int  # LLM tokens, merged image and video tokens included
    patches: tuple[int, ...]  # vision patches of each image or video, before the 2x2 merge
    loss_tokens: Optional[int]  # positions trained with loss; None where the source does not say


# ---------------------------------------------------------------- readers, one per set


def coco_chats(path: Path) -> list[Chat]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return _coco(data)


def _coco(data: dict) -> list[Chat]:
    sizes = {image["id"]: (image["width"], image["height"]) for image in data["images"]}
    return [Chat(DESCRIBE_PROMPT, a["caption"].strip(), [sizes[a["image_id"]]]) for a in data["annotations"]]


def mathvista_chats(path: Path) -> list[Chat]:
    return _mathvista(json.loads(Path(path).read_text(encoding="utf-8")))


def _mathvista(data: dict) -> list[Chat]:
    chats = []
    for key in sorted(data, key=int):
        item = data[key]
        question = "<image>" + str(item["question"])
        if item.get("choices"):
            question += "\nChoices: " + "; ".join(str(c) for c in item["choices"])
        meta = item["metadata"]
        if isinstance(meta, str):  # some copies store it as a Python dict literal
            meta = ast.literal_eval(meta)
        chats.append(Chat(question, str(item.get("answer", "")), [(meta["img_width"], meta["img_height"])]))
    return chats


def arena_hard_chats(path: Path) -> list[Chat]:
    """Model-answer JSONL: the user prompt, then the answer (``{"answer": ...}`` objects)."""
    chats = []
    for line in _jsonl_lines(Path(path)):
        messages = json.loads(line)["messages"]
        texts = [m["content"].get("answer", "") if isinstance(m["content"], dict) else str(m["content"])
                 for m in messages]
        chats.append(Chat(texts[0], "\n".join(texts[1:])))
    return chats


def alpaca_chats(path: Path) -> list[Chat]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return [Chat("\n".join(p for p in (r["instruction"], r.get("input", "")) if p), r["output"]) for r in data]


def omnibal_sizes(path: Path) -> list[SampleSize]:
    """OmniBal cost CSV: ``token_num`` is the LLM length; each of ``vit_num`` tiles is 1024 patches."""
    with open(path, newline="", encoding="utf-8") as f:
        return [SampleSize(int(row["token_num"]), (INTERNVL_TILE_PATCHES,) * int(row["vit_num"]), None)
                for row in csv.DictReader(f)]


def _jsonl_lines(path: Path) -> list[str]:
    # Split on "\n" only: str.splitlines also splits at U+2028 inside JSON strings.
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


# ---------------------------------------------------------------- which reader a file needs

ChatReader = Callable[[Path], list[Chat]]


def chat_reader(path: Path) -> Optional[ChatReader]:
    """The reader of a COCO captions, MathVista, arena-hard answers or alpaca file; None for
    anything else (conversation files among them)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        first = json.loads(_first_line(path) or "{}")
        messages = first.get("messages") if isinstance(first, dict) else None
        if isinstance(messages, list) and any(isinstance(m.get("content"), dict) for m in messages):
            return arena_hard_chats
        return None
    if path.suffix != ".json":
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if head.startswith("[") and '"instruction"' in head and '"output"' in head:
        return alpaca_chats
    if not head.startswith("{"):
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError:  # JSON lines saved as .json
        return None
    if isinstance(data, dict) and "images" in data and "annotations" in data:
        return coco_chats
    if isinstance(data, dict) and data and all(isinstance(v, dict) and "metadata" in v for v in data.values()):
        return mathvista_chats
    return None


def is_omnibal_csv(path: Path) -> bool:
    if Path(path).suffix != ".csv":
        return False
    header = _first_line(Path(path)).strip().split(",")
    return "vit_num" in header and "token_num" in header


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.readline()


# ---------------------------------------------------------------- sizing


class SampleSizer:
    """Sizes samples as ``pack`` measures them, for a preset's tokenizer, template and image rules."""

    def __init__(self, preset: str):
        cfg = load_run_config(preset, overrides=[f"data.seq_len={_NO_SEQ_LIMIT}"])
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.measurer = SampleMeasurer(self.tokenizer, cfg.data, cfg.model)

    def size(self, sample: Union[ConversationSample, Reject]) -> Union[SampleSize, Reject]:
        """One sample (a chat's ``to_sample()`` or a conversation file's record); a Reject for one
        ``pack`` would reject (unreadable media, extreme aspect ratio), never for its length."""
        measured = sample if isinstance(sample, Reject) else self.measurer.measure(sample)
        if not isinstance(measured, MeasuredSample):
            return measured
        grids = list(measured.image_grids) + [plan.grid_thw for plan in measured.video_plans]
        return SampleSize(measured.length, tuple(t * h * w for t, h, w in grids), measured.loss_tokens)

    def size_chats(self, chats: Sequence[Chat], name: str = "chat") -> list[Union[SampleSize, Reject]]:
        return [self.size(chat.to_sample(f"{name}:{k}")) for k, chat in enumerate(chats)]
