"""The parquet schema of pack shards: one row per pack, one list entry per sample in the pack.

A row holds everything ``train`` needs to rebuild the packed row without re-tokenizing or
re-probing media: token ids with media pads expanded, the answer mask, the images (absolute
path, or encoded bytes when the input carried them), their grids, and each video's frame plan.
Pixels are decoded at training time, as for ``data.source=files``. Each pack is its own row
group, so a reader fetches one pack without reading its shard.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa

from loongforge.data.measure import MeasuredSample
from loongforge.data.samples import sample_file
from loongforge.data.vision import VideoPlan

IMAGE = pa.struct([("path", pa.string()), ("bytes", pa.binary())])
VIDEO_PLAN = pa.struct([
    ("frame_indices", pa.list_(pa.int32())),
    ("resized_height", pa.int32()),
    ("resized_width", pa.int32()),
    ("grid_thw", pa.list_(pa.int32())),
    ("second_per_grid_t", pa.float64()),
    ("fps", pa.float64()),  # the video's frame rate; null in folders packed before it was kept
])
SCHEMA = pa.schema([
    ("pack", pa.int64()),
    ("sample_ids", pa.list_(pa.string())),
    ("input_ids", pa.list_(pa.list_(pa.int32()))),  # per sample [L]
    ("is_answer", pa.list_(pa.list_(pa.bool_()))),  # per sample [L]
    ("images", pa.list_(pa.list_(IMAGE))),
    ("image_grid_thw", pa.list_(pa.list_(pa.list_(pa.int32())))),  # per sample, per image [t, h, w]
    # per sample, per image [height, width] in pixels; shards written before this column read as none
    ("image_sizes", pa.list_(pa.list_(pa.list_(pa.int32())))),
    # per sample, per image its processor's own facts as a JSON object (MeasuredSample.image_facts); per
    # sample [] where the processor gives none; shards written before this column read as none
    ("image_facts", pa.list_(pa.list_(pa.string()))),
    ("videos", pa.list_(pa.list_(pa.string()))),
    ("video_plans", pa.list_(pa.list_(VIDEO_PLAN))),
    # per sample its ordinal in its file (MeasuredSample.record), what names it
    ("sample_records", pa.list_(pa.int64())),
    ("sample_lines", pa.list_(pa.int64())),  # per sample the line it starts at, for people
])


def encode_pack(pack: int, samples: list[MeasuredSample]) -> dict:
    """One shard row from the measured samples of a pack, in pack order."""
    return {
        "pack": pack,
        "sample_ids": [s.sample_id for s in samples],
        "input_ids": [s.input_ids.astype(np.int32) for s in samples],
        "is_answer": [s.is_answer.astype(bool) for s in samples],
        "images": [[_image_ref(image) for image in s.images] for s in samples],
        "image_grid_thw": [[list(grid) for grid in s.image_grids] for s in samples],
        "image_sizes": [[list(size) for size in s.image_sizes] for s in samples],
        "image_facts": [[json.dumps(facts, sort_keys=True) for facts in s.image_facts] for s in samples],
        "videos": [[os.path.abspath(str(video)) for video in s.videos] for s in samples],
        "video_plans": [[_plan_dict(plan) for plan in s.video_plans] for s in samples],
        "sample_records": [s.record for s in samples],
        "sample_lines": [s.line for s in samples],
    }


def _image_ref(image) -> dict:
    if isinstance(image, bytes):
        return {"path": None, "bytes": image}
    if isinstance(image, (str, os.PathLike)):
        return {"path": os.path.abspath(str(image)), "bytes": None}
    raise TypeError(f"cannot store an in-memory {type(image).__name__} image in a pack shard")


def _plan_dict(plan: VideoPlan) -> dict:
    return {"frame_indices": list(plan.frame_indices), "resized_height": plan.resized_height,
            "resized_width": plan.resized_width, "grid_thw": list(plan.grid_thw),
            "second_per_grid_t": plan.second_per_grid_t, "fps": plan.fps}


def decode_pack(row: dict) -> list[MeasuredSample]:
    """The pack's samples back from a shard row (``Table.to_pylist()`` element)."""
    samples = []
    sizes = row.get("image_sizes") or [[] for _ in row["sample_ids"]]
    facts = row.get("image_facts") or [[] for _ in row["sample_ids"]]
    for k, sample_id in enumerate(row["sample_ids"]):
        samples.append(MeasuredSample(
            sample_id=sample_id, file=sample_file(sample_id), line=row["sample_lines"][k],
            input_ids=np.asarray(row["input_ids"][k], dtype=np.int64),
            is_answer=np.asarray(row["is_answer"][k], dtype=bool),
            images=[ref["bytes"] if ref["bytes"] is not None else ref["path"] for ref in row["images"][k]],
            image_grids=[tuple(grid) for grid in row["image_grid_thw"][k]],
            image_sizes=[tuple(size) for size in sizes[k]],
            image_facts=[json.loads(text) for text in facts[k]],
            videos=list(row["videos"][k]),
            video_plans=[VideoPlan(frame_indices=tuple(p["frame_indices"]), resized_height=p["resized_height"],
                                   resized_width=p["resized_width"], grid_thw=tuple(p["grid_thw"]),
                                   second_per_grid_t=p["second_per_grid_t"], fps=p.get("fps"))
                        for p in row["video_plans"][k]],
            record=row["sample_records"][k],
        ))
    return samples
