"""Plan stage: scan records -> packs -> ``manifest.jsonl`` (one line per pack) + ``rejects.jsonl``.

Manifest line (the balancer and ``train`` read these names)::

    {"pack": i, "shard": "shards/shard-00000.parquet", "row": r, "tokens": total,
     "samples": [{"id": "<file>[<record>]", "file": ..., "line": ..., "record": ..., "index": n, "tokens": L,
                  "patches": [P per image, then per video], "images": n_img, "videos": n_vid,
                  "loss_tokens": tokens with loss (the LM head runs on these)}]}

``index`` is the sample's position in the inputs (files in order, records in file order); ``record``
its ordinal in its file (``samples.sample_id_of``; in ``rejects.jsonl`` too); a piece of a document
longer than the pack (``measure.document_pieces``) also has ``"piece"``.
Pack ``i`` is row ``i % packs_per_shard`` of shard ``i // packs_per_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from loongforge.config.errors import ConfigError
from loongforge.data.packing import padded_length
from loongforge.data.packfile.folder import MANIFEST_FILE, REJECTS_FILE, shard_name, write_lines_atomic
from loongforge.pack.algorithms import plan_packs

KIND_TEXT, KIND_IMAGE, KIND_VIDEO = 0, 1, 2


@dataclass
class Plan:
    accepted: list[dict]  # scan records of usable samples, input order
    rejected: list[dict]  # scan records of rejects, input order
    packs: list[np.ndarray]  # per pack: positions into ``accepted``
    packs_per_shard: int

    @property
    def num_shards(self) -> int:
        return -(-len(self.packs) // self.packs_per_shard)

    def shard_packs(self, shard: int) -> range:
        return range(shard * self.packs_per_shard, min(len(self.packs), (shard + 1) * self.packs_per_shard))

    def lengths(self) -> np.ndarray:
        return np.array([r["tokens"] for r in self.accepted], dtype=np.int64)


def media_kind(record: dict) -> int:
    return KIND_VIDEO if record["videos"] else KIND_IMAGE if record["images"] else KIND_TEXT


def make_plan(records: list[dict], *, seq_len: int, algorithm: str, max_images: Optional[int],
              group_by_media: bool, packs_per_shard: int, sample_multiple: int = 1) -> Plan:
    """``sample_multiple``: each sample takes its length rounded up to a multiple of it in a pack, as
    training under context parallelism pads it (``--context-parallel``)."""
    accepted = [r for r in records if "reason" not in r]
    rejected = [r for r in records if "reason" in r]
    lengths = np.array([padded_length(r["tokens"], sample_multiple) for r in accepted], dtype=np.int64)
    media = np.array([r["images"] + r["videos"] for r in accepted], dtype=np.int64)
    if max_images is not None and len(media) and media.max() > max_images:
        worst = accepted[int(np.argmax(media))]
        raise ConfigError(f"--max-images-per-pack {max_images} is below the {int(media.max())} images/videos of "
                          f"{worst['id']}; raise it or leave it unset")
    kinds = np.array([media_kind(r) for r in accepted], dtype=np.int64)
    packs = plan_packs(lengths, seq_len, algorithm, media_counts=media, max_images=max_images, kinds=kinds,
                       group_by_media=group_by_media) if accepted else []
    return Plan(accepted=accepted, rejected=rejected, packs=packs, packs_per_shard=packs_per_shard)


def manifest_lines(plan: Plan) -> Iterator[dict]:
    for number, members in enumerate(plan.packs):
        samples = [_manifest_sample(plan.accepted[k]) for k in members.tolist()]
        yield {"pack": number, "shard": shard_name(number // plan.packs_per_shard),
               "row": number % plan.packs_per_shard, "tokens": sum(s["tokens"] for s in samples),
               "samples": samples}


def _manifest_sample(record: dict) -> dict:
    return {"id": record["id"], **_where(record), "index": record["i"],
            "tokens": record["tokens"], "patches": record["patches"], "images": record["images"],
            "videos": record["videos"], "loss_tokens": record.get("loss_tokens")}


def _where(record: dict) -> dict:
    """file and line, and the record's ordinal in its file and the document's piece where the scan
    gave them."""
    return {key: record[key] for key in ("file", "line", "record", "piece") if key in record}


def reject_lines(plan: Plan) -> Iterator[dict]:
    for r in plan.rejected:
        yield {**_where(r), "reason": r["reason"], "detail": r["detail"]}


def write_plan(root: Path, plan: Plan) -> None:
    """Rejects first, manifest last: an existing manifest means the plan stage finished."""
    write_lines_atomic(root / REJECTS_FILE, reject_lines(plan))
    write_lines_atomic(root / MANIFEST_FILE, manifest_lines(plan))
