"""``loongforge convert SRC --roundtrip``: HF -> a sharded megatron checkpoint on disk -> HF.

Each HF tensor goes through the code a real run uses: every TP rank's tensor is made by the mapping
table's ``shard`` (what ``loongforge train checkpoint.load_hf=`` loads into that rank), and is
written where that rank's shard lies in dist_checkpointing's global layout (``rank_regions``:
contiguous chunks along the split axis, the gate and up halves of a SwiGLU weight as two chunks,
vision tensors at the vision TP size, replicated tensors once, language layers one chunk per layer
as every pipeline stage writes them). The torch_dist folder is written by ``mcore_io.write_mcore``
into a temporary folder (as large as the model; removed afterwards), then every tensor is read back
whole by ``mcore_io.McoreReader`` and mapped to HF as ``convert --to hf`` does. A rank's shard in
the wrong place, a writer or reader that mixes chunks, or a transform that does not invert shows.

Buckets per tensor: ``exact`` (bit-identical), ``close`` (``allclose`` rtol 1e-4, atol 1e-6),
``different``; plus HF keys that did not come back (``missing``) or appeared (``unexpected``).
A source tensor stored in a layout the map reads but does not write (the Hub's transposed
Qwen3-VL-MoE experts) is compared in the written layout (``Transform.as_written``): same values.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from loongforge.convert.engine import (
    Link, Progress, build_links, check_hf_tensors, check_layout, megatron_shapes, to_hf,
    vocab_rows_at)
from loongforge.convert.hf_io import HFCheckpoint
from loongforge.convert.mcore_io import McoreItem, McoreReader, stacked, write_mcore
from loongforge.models.hf.rules import (
    VISION, Copies, FusedExperts, FusedHeadQKV, GatedGroupedQKV, GateUp, GroupedQKV, GroupedRows, Split, Transform, Vocab)

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
    vision_tp: Optional[int]  # None: a text-only model
    tensors: list[TensorResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unread: int = 0  # tensors under the family's ``hf_unread`` prefixes (not part of the model)

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
        if self.unread:
            lines.append(f"{self.unread} tensors of the source not read (the family's unread prefixes)")
        c = self.counts()
        vision = "" if self.vision_tp is None else f", vision_tp={self.vision_tp}"
        lines.append(f"round trip HF -> mcore (tp={self.tp}, pp={self.pp}{vision}) -> HF: "
                     f"{c[EXACT]} exact, {c[CLOSE]} close, {c[DIFFERENT]} different, {len(self.missing)} missing, "
                     f"{len(self.unexpected)} unexpected: {'EXACT' if self.exact else 'NOT EXACT'}")
        return "\n".join(lines)


Region = tuple[tuple[int, ...], torch.Tensor]  # offsets in the global tensor, the piece there


def rank_regions(transform: Transform, local: torch.Tensor, rank: int, size: int) -> list[Region]:
    """Where TP rank ``rank`` of ``size`` writes its tensor ``local`` in the global (TP=1) tensor,
    as megatron-core's sharded state dict places it. Replicated tensors: rank 0 writes them."""
    zeros = [0] * local.dim()
    if isinstance(transform, Copies):  # one tensor the HF checkpoint stores several times
        return rank_regions(transform.base, local, rank, size)
    if isinstance(transform, FusedExperts):  # [E, ...]: each expert's regions, stacked on the expert axis
        per_expert = [rank_regions(transform.per_expert, expert, rank, size) for expert in local]
        return [((0, *offsets), torch.stack([regions[part][1] for regions in per_expert]))
                for part, (offsets, _) in enumerate(per_expert[0])]
    if isinstance(transform, GateUp):  # [gate shard; up shard] -> two chunks of the [gate; up] rows
        gate, up = local.chunk(2, dim=0)
        rows = gate.shape[0]
        return [((rank * rows, *zeros[1:]), gate), ((size * rows + rank * rows, *zeros[1:]), up)]
    if isinstance(transform, (Vocab, GroupedQKV, GatedGroupedQKV, GroupedRows, FusedHeadQKV)):
        dim = 0
    elif isinstance(transform, Split):
        dim = transform.dim
    else:  # the same on every rank
        return [(tuple(zeros), local)] if rank == 0 else []
    offsets = list(zeros)
    offsets[dim] = rank * local.shape[dim]
    return [(tuple(offsets), local)]


def _sharded_items(link: Link, checkpoint: HFCheckpoint, global_shape: tuple[int, ...],
                   size: int) -> list[McoreItem]:
    """The chunks the ``size`` ranks of ``link``'s TP group write for it (one layer of it if stacked)."""
    def local(rank: int) -> torch.Tensor:
        return link.rule.transform.shard([checkpoint.load(k) for k in link.hf_keys], rank, size)

    def piece(rank: int, index: int) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            tensor = rank_regions(link.rule.transform, local(rank), rank, size)[index][1]
            return stacked(tensor, link.stack)
        return make

    dtype = checkpoint.entries[link.hf_keys[0]].dtype
    items = []
    for rank in range(size):
        # Shapes only: the transforms run on meta tensors here, on data when the writer asks.
        meta = link.rule.transform.shard(
            [torch.empty(checkpoint.entries[k].shape, device="meta") for k in link.hf_keys], rank, size)
        for index, (offsets, region) in enumerate(rank_regions(link.rule.transform, meta, rank, size)):
            sizes = tuple(region.shape)
            offsets, sizes = (*link.stack, *offsets), (*(1,) * len(link.stack), *sizes)
            items.append(McoreItem(link.mcore_key, global_shape, dtype, link.layer, piece(rank, index),
                                   region=(offsets, sizes), expert=link.expert))
    return items


def _compare(key: str, expected: torch.Tensor, actual: torch.Tensor) -> TensorResult:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return TensorResult(key, DIFFERENT, float("inf"))
    diff = (expected.double() - actual.double()).abs().max().item() if expected.numel() else 0.0
    if torch.equal(expected, actual):
        return TensorResult(key, EXACT, diff)
    status = CLOSE if torch.allclose(expected.double(), actual.double(), rtol=1e-4, atol=1e-6) else DIFFERENT
    return TensorResult(key, status, diff)


def roundtrip(src: Path, *, tp: int = 1, pp: int = 1, vision_tp: Optional[int] = None, vp: Optional[int] = None,
              pipeline_layout: Optional[str] = None, progress: bool = True,
              work_dir: Optional[Path] = None) -> RoundTripReport:
    """Write SRC as the ranks of TP ``tp`` (vision TP ``vision_tp``) would to a temporary folder
    under ``work_dir`` (default: the system's), read it back and compare with SRC tensor by tensor.
    ``pp`` is checked against the model; every stage writes its layers one chunk per layer, so the
    files do not depend on it."""
    checkpoint = HFCheckpoint(Path(src))
    model_cfg = checkpoint.model_config()
    hf_shapes = check_hf_tensors(checkpoint, model_cfg, str(Path(src) / "config.json"))
    check_layout(model_cfg, tp, pp, vision_tp, vp=vp, pipeline_layout=pipeline_layout)
    vision_tp = vision_tp or tp
    vocab_rows = vocab_rows_at(model_cfg, tp)
    # A text-only model has no vision TP to report.
    report = RoundTripReport(str(src), tp, pp, None if model_cfg.vision is None else vision_tp)
    links = build_links(model_cfg)
    shapes = megatron_shapes(links, hf_shapes, model_cfg, vocab_rows)
    items = [item for link in links for item in _sharded_items(
        link, checkpoint, shapes[link.mcore_key], vision_tp if link.rule.group == VISION else tp)]
    produced = set()
    with tempfile.TemporaryDirectory(prefix="loongforge-roundtrip-", dir=work_dir) as tmp:
        folder = Path(tmp) / "model_optim"
        bar = Progress(len(items), "round trip: write", progress)
        write_mcore(folder, items, lambda item, tensor: bar.update(tensor.nbytes))
        bar.close()
        reader = McoreReader(folder)
        bar = Progress(len(links), "round trip: read", progress)
        for link in links:
            chunk = reader.read(link.mcore_key, link.layer, link.expert)
            sources = link.rule.transform.as_written([checkpoint.load(key) for key in link.hf_keys])
            for key, source, tensor in zip(link.hf_keys, sources, to_hf(link, chunk)):
                report.tensors.append(_compare(key, source, tensor))
                produced.add(key)
            bar.update(chunk.nbytes)
        bar.close()
    read = {key for key in checkpoint.entries if not key.startswith(checkpoint.family.hf_unread)}
    report.unread = len(checkpoint.entries) - len(read)
    report.missing = sorted(read - produced)
    report.unexpected = sorted(produced - read)
    return report
