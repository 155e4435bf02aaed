"""Record types shared by the file reader, the synthetic generator and the pipeline."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from loongforge.data.template import Turn
from loongforge.data.vision import ImageSource

# Why a sample was skipped. Every skipped sample is reported with exactly one of these.
REJECT_REASONS = (
    "malformed_json",  # unparsable JSON, or a record without the expected fields/types
    "bad_roles",  # unknown role, or turns not system? (user assistant)+
    "empty_answer",  # an assistant turn with no text
    "missing_image",  # an image/video file that does not exist
    "corrupt_image",  # an image/video that cannot be read or decoded
    "too_long",  # more LLM tokens than data.seq_len
    "media_mismatch",  # <image>/<video> placeholder count != number of images/videos
    "missing_embedding",  # data.vision_embeddings holds no stored features for one of its media
    "media_in_text_model",  # an image or video for a model without a vision tower
    "video_in_image_model",  # a video for a model whose processor takes images only (InternVL's frames)
    "beyond_vocabulary",  # a token of the tokenizer that the model has no embedding row for, typed in the text
)


# (file, line, record, reason): one rejected sample, however often it is met.
RejectKey = tuple[str, int, Optional[int], str]
# A sample id: "<file>[<ordinal>]", then "#<piece>" for a piece of a cut document (measure.document_pieces).
_SAMPLE_ID = re.compile(r"(?P<file>.*)\[(?P<record>\d+)\](?:#\d+)?")


def sample_id_of(file: str, record: int) -> str:
    """The id of the record at ordinal ``record`` of ``file`` (``conversations._Located.ordinal``):
    unique per record, where a line is not (a JSON list on one line, a COCO captions file)."""
    return f"{file}[{record}]"


def sample_file(sample_id: str) -> str:
    """The file a sample id names; the id itself for ids not made by ``sample_id_of`` (synthetic data)."""
    match = _SAMPLE_ID.fullmatch(sample_id)
    return match["file"] if match else sample_id


@dataclass(frozen=True)
class Reject:
    """A skipped sample: ``line`` is the 1-based line (JSON/JSONL) or row (parquet) it starts at,
    for people; ``record`` its ordinal in the file (``ConversationSample.record``), what names it."""

    file: str
    line: int
    reason: str
    detail: str
    record: Optional[int] = None

    def __post_init__(self):
        if self.reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {self.reason!r}")

    @classmethod
    def of(cls, sample, reason: str, detail: str) -> "Reject":
        """The reject of ``sample`` (anything with ``file``, ``line`` and ``record``)."""
        return cls(file=sample.file, line=sample.line, reason=reason, detail=detail, record=sample.record)

    @property
    def key(self) -> RejectKey:
        """Identity used to count a reject once, however many epochs (or ranks) meet it."""
        return (self.file, self.line, self.record, self.reason)

    def to_json(self) -> dict:
        """``file``, ``line``, ``reason``, ``detail``, and ``record`` where the sample has one (a
        record of a data file)."""
        fields = asdict(self)
        if self.record is None:
            del fields["record"]
        return fields


@dataclass
class ConversationSample:
    """One conversation as read, before tokenization. Media are paths (resolved against the
    data file's folder), encoded bytes, or decoded PIL images (synthetic data)."""

    sample_id: str  # "<file>[<record>]" (``sample_id_of``) or "synthetic:<index>"
    file: str
    line: int  # where the record starts, for people: records may share one (a JSON array on one line)
    turns: list[Turn]
    images: list[ImageSource] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    # The record's 0-based ordinal in its file (``conversations._Located.ordinal``): with ``file``,
    # what names the sample (its id, its stored embeddings, its reject). None off a data file.
    record: Optional[int] = None


@dataclass
class TextSample:
    """One pretraining document (``text`` record, or a line of a ``.txt`` file): trained on every
    token, no chat template; ``file``, ``line``, ``record`` as in ConversationSample."""

    sample_id: str
    file: str
    line: int
    text: str
    record: Optional[int] = None

    @property
    def images(self) -> tuple:
        return ()  # no media: code that walks a sample's media reads text samples unchanged

    @property
    def videos(self) -> tuple:
        return ()


@dataclass
class PreferenceSample:
    """One preference pair as read (``data.preference``): the shared prompt turns, each side's answer
    text and the prompt's media; ``sample_id``, ``file``, ``line``, ``record`` as in ConversationSample
    (the pair's, shared by both sides: a pair is one unit)."""

    sample_id: str
    file: str
    line: int
    prompt: list[Turn]
    chosen: str
    rejected: str
    images: list[ImageSource] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    record: Optional[int] = None

    def side(self, which: str) -> ConversationSample:
        """Side ``which`` ("chosen" or "rejected") as a conversation: the prompt, then its answer as the
        last assistant turn."""
        answer = {"chosen": self.chosen, "rejected": self.rejected}[which]
        return ConversationSample(sample_id=self.sample_id, file=self.file, line=self.line,
                                  turns=[*self.prompt, Turn("assistant", answer)], images=list(self.images),
                                  videos=list(self.videos), record=self.record)


# What a data source's ``get`` returns when the record is usable.
Sample = Union[ConversationSample, TextSample, PreferenceSample]
