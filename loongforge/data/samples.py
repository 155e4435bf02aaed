"""Record types shared by the file reader, the synthetic generator and the pipeline."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
)


@dataclass(frozen=True)
class Reject:
    """A skipped sample: ``line`` is the 1-based line (JSON/JSONL) or row (parquet) it starts at."""

    file: str
    line: int
    reason: str
    detail: str

    def __post_init__(self):
        if self.reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {self.reason!r}")

    @property
    def key(self) -> tuple[str, int, str]:
        """Identity used to count a reject once, however many epochs meet it."""
        return (self.file, self.line, self.reason)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ConversationSample:
    """One conversation as read, before tokenization. Media are paths (resolved against the
    data file's folder), encoded bytes, or decoded PIL images (synthetic data)."""

    sample_id: str  # "<file>:<line>" or "synthetic:<index>"
    file: str
    line: int
    turns: list[Turn]
    images: list[ImageSource] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
