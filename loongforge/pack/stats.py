"""``stats.json``: what went in, what was packed, what was dropped and why, and how full packs are.

Only deterministic numbers live here (no timings), so identical runs give identical files.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from loongforge.data.packfile.folder import FORMAT
from loongforge.data.samples import REJECT_REASONS
from loongforge.pack.algorithms import quadratic_costs
from loongforge.pack.manifest import Plan

HISTOGRAM_BINS = 32


def histogram(values: np.ndarray, upper: int, bins: int = HISTOGRAM_BINS) -> dict:
    edges = np.linspace(0, upper, bins + 1).round().astype(np.int64)
    counts, _ = np.histogram(values, bins=edges)
    return {"bin_edges": edges.tolist(), "counts": counts.tolist()}


def compute_stats(plan: Plan, *, seq_len: int, algorithm: str, preset: str, max_images: int | None,
                  group_by_media: bool, vision_sizing: dict, sample_multiple: int = 1) -> dict:
    """Token counts and fill are of the samples' own tokens; ``sample_multiple`` records what each
    sample was counted at (its length rounded up to a multiple of it), which training checks
    (``PackedFolder.check_compatible``)."""
    lengths = plan.lengths()
    pack_tokens = np.array([int(lengths[p].sum()) for p in plan.packs], dtype=np.int64)
    costs = quadratic_costs(plan.packs, lengths) if plan.packs else np.zeros(0)
    reasons = Counter(r["reason"] for r in plan.rejected)
    packed = {r["i"] for r in plan.accepted}  # a document cut into pieces is one sample
    samples_in = len(packed) + len(plan.rejected)
    return {
        "format": FORMAT,
        "samples_in": samples_in,
        "samples_packed": len(packed),
        "documents_cut": len({r["i"] for r in plan.accepted if r.get("piece") is not None}),
        "samples_rejected": len(plan.rejected),
        "packs": len(plan.packs),
        "shards": plan.num_shards,
        "tokens_packed": int(lengths.sum()),
        "fill_ratio": round(float(pack_tokens.sum()) / (len(plan.packs) * seq_len), 6) if plan.packs else 0.0,
        "rejects_by_reason": {reason: reasons.get(reason, 0) for reason in REJECT_REASONS},
        "seq_len": seq_len,
        "algorithm": algorithm,
        "preset": preset,
        "max_images_per_pack": max_images,
        "group_by_media": group_by_media,
        "sample_multiple": sample_multiple,
        "samples_per_pack": _summary(np.array([len(p) for p in plan.packs])),
        "pack_attention_cost_cv": round(float(costs.std() / costs.mean()), 6) if len(costs) else 0.0,
        "length_histogram": histogram(lengths, seq_len),
        "pack_fill_histogram": histogram(pack_tokens, seq_len),
        "vision_sizing": vision_sizing,
    }


def _summary(values: np.ndarray) -> dict:
    if not len(values):
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": int(values.min()), "mean": round(float(values.mean()), 4), "max": int(values.max())}
