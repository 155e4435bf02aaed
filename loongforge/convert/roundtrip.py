"""``loongforge convert SRC --roundtrip``: HF -> megatron -> HF in memory, tensor by tensor.

Each HF tensor goes through the same code as a real conversion (mapping transform into the global
megatron layout, vocabulary padding for the TP size), is then cut into the pieces the TP ranks hold
(dist_checkpointing's slicing of that layout: contiguous chunks along the split axis, gate and up
halves each chunked for SwiGLU, vision tensors at the vision TP size) and put back together, and
finally mapped back to HF. Nothing is written.

Buckets per tensor: ``exact`` (bit-identical), ``close`` (``allclose`` rtol 1e-4, atol 1e-6),
``different``; plus HF keys that did not come back (``missing``) or appeared (``unexpected``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from loongforge.convert.engine import (
    Progress,
    build_links,
    check_hf_tensors,
    check_layout,
    model_config_of,
    to_hf,
    to_megatron,
    vocab_rows_at,
)
from loongforge.convert.hf_io import HFCheckpoint
from loongforge.models.hf_rules import (
    VISION,
    FusedHeadQKV,
    GateUp,
    GroupedQKV,
    Split,
    Transform,
    Vocab,
)

EXACT, CLOSE, DIFFERENT = "exact", "close", "different"


@dataclass
class TensorResult:
    key: str
    status: str
    max_abs_diff: float


@dataclass
class RoundTripReport:
    src: str
    tp: int
    pp: int
    vision_tp: int
    tensors: list[TensorResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.missing and not self.unexpected and all(t.status == EXACT for t in self.tensors)

    def counts(self) -> dict[str, int]:
        out = {EXACT: 0, CLOSE: 0, DIFFERENT: 0}
        for t in self.tensors:
            out[t.status] += 1
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "counts": self.counts(), "exact": self.exact}

    def table(self) -> str:
        width = max([len(t.key) for t in self.tensors] + [6])
        lines = [f"{'tensor':<{width}}  {'status':<9}  max_abs_diff"]
        lines += [f"{t.key:<{width}}  {t.status:<9}  {t.max_abs_diff:.3e}" for t in self.tensors]
        lines += [f"{k:<{width}}  {'missing':<9}  -" for k in self.missing]
        lines += [f"{k:<{width}}  {'unexpected':<9}  -" for k in self.unexpected]
        c = self.counts()
        lines.append(f"round trip HF -> mcore (tp={self.tp}, pp={self.pp}, vision_tp={self.vision_tp}) -> HF: "
                     f"{c[EXACT]} exact, {c[CLOSE]} close, {c[DIFFERENT]} different, {len(self.missing)} missing, "
                     f"{len(self.unexpected)} unexpected: {'EXACT' if self.exact else 'NOT EXACT'}")
        return "\n".join(lines)


def _split_join(transform: Transform, tensor: torch.Tensor, size: int, stacked: bool) -> torch.Tensor:
    """Cut a global megatron tensor into ``size`` TP pieces the way the ranks load it, and rejoin."""
    offset = 1 if stacked else 0
    if size == 1:
        return tensor.clone()
    if isinstance(transform, GateUp):
        gate, up = tensor.chunk(2, dim=offset)
        ranks = [torch.cat([g, u], dim=offset) for g, u in zip(gate.chunk(size, offset), up.chunk(size, offset))]
        halves = [r.chunk(2, dim=offset) for r in ranks]
        return torch.cat([torch.cat([h[0] for h in halves], offset), torch.cat([h[1] for h in halves], offset)], offset)
    if isinstance(transform, (Vocab, GroupedQKV, FusedHeadQKV)):
        dim = 0
    elif isinstance(transform, Split):
        dim = transform.dim
    else:  # replicated on every rank
        return tensor.clone()
    pieces = tensor.chunk(size, dim=dim + offset)
    return torch.cat([p.clone() for p in pieces], dim=dim + offset)


def _compare(key: str, expected: torch.Tensor, actual: torch.Tensor) -> TensorResult:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return TensorResult(key, DIFFERENT, float("inf"))
    diff = (expected.double() - actual.double()).abs().max().item() if expected.numel() else 0.0
    if torch.equal(expected, actual):
        return TensorResult(key, EXACT, diff)
    status = CLOSE if torch.allclose(expected.double(), actual.double(), rtol=1e-4, atol=1e-6) else DIFFERENT
    return TensorResult(key, status, diff)


def roundtrip(src: Path, *, tp: int = 1, pp: int = 1, vision_tp: Optional[int] = None,
              progress: bool = True) -> RoundTripReport:
    checkpoint = HFCheckpoint(Path(src))
    model_cfg = model_config_of(checkpoint.config, str(Path(src) / "config.json"))
    check_hf_tensors(checkpoint, model_cfg, str(Path(src) / "config.json"))
    check_layout(model_cfg, tp, pp, vision_tp)
    vision_tp = vision_tp or tp
    vocab_rows = vocab_rows_at(model_cfg, tp)
    report = RoundTripReport(str(src), tp, pp, vision_tp)
    links = build_links(model_cfg)
    produced = set()
    bar = Progress(len(links), "round trip", progress)
    for link in links:
        originals = [checkpoint.load(k) for k in link.hf_keys]
        chunk = to_megatron(link, originals, vocab_rows)
        size = vision_tp if link.rule.group == VISION else tp
        chunk = _split_join(link.rule.transform, chunk, size, stacked=link.layer is not None)
        back = to_hf(link, chunk if link.layer is None else chunk[0])
        for key, original, tensor in zip(link.hf_keys, originals, back):
            report.tensors.append(_compare(key, original, tensor))
            produced.add(key)
        bar.update(chunk.nbytes)
    bar.close()
    report.missing = sorted(set(checkpoint.entries) - produced)
    report.unexpected = sorted(produced - set(checkpoint.entries))
    return report
