"""``run_pack``: the scan -> plan -> write stages over one output folder, resumable.

A folder is created with ``pack_config.json`` (inputs, flags, tokenizer and image rules: all
that decides the output, and nothing that does not, such as ``workers``). ``resume=True``
accepts a folder only if its config matches, removes partial ``*.tmp`` files, and then each
stage skips what is already on disk: scan chunks, the manifest, shards. The plan is recomputed
from the scan (it is deterministic and takes seconds), so shards written before a kill and
after it belong to the same plan. ``stats.json`` is written last.

Inputs with mixture weights (``path@weight``, ``loongforge.data.mixture``) are packed in the
mixture's draw order: one block of as many draws as the inputs hold samples (data.seed,
data.shuffle of the preset), so a source weighted up appears more than once and one weighted down
in part; the folder then holds the mix, and ``stats.json`` the samples and tokens of each source.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.layout import context_sample_multiple
from loongforge.config.loader import load_run_config
from loongforge.config.overrides import Override
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.conversations import expand_data_paths
from loongforge.data.measure import vision_sizing
from loongforge.data.mixture import Mixture, build_mixture, check_entries_usable, entry_weights, source_names
from loongforge.data.record_kinds import reading_for
from loongforge.data.packfile import folder
from loongforge.data.packfile.folder import (
    CONFIG_FILE,
    FORMAT,
    MANIFEST_FILE,
    STATS_FILE,
    remove_partial_files,
    write_atomic,
)
from loongforge.pack import workers
from loongforge.pack.algorithms import ALGORITHMS
from loongforge.pack.manifest import make_plan, write_plan
from loongforge.pack.scan import num_chunks, read_scan, run_scan
from loongforge.pack.stats import compute_stats
from loongforge.pack.write import run_write, shard_tasks

# Called after each finished unit of work with ("scan", chunk) or ("write", shard); tests use it
# to interrupt a run at a known point.
FaultHook = Callable[[str, int], None]


@dataclass(frozen=True)
class PackOptions:
    inputs: tuple[str, ...]
    output: Path
    preset: str
    seq_len: int
    algorithm: str = "bfd"
    workers: int = 1
    max_images_per_pack: Optional[int] = None
    group_by_media: bool = False
    resume: bool = False
    # Packs per parquet shard: a shard is the unit of resumable write work (~ a few hundred MB of
    # tokens at 32K seq_len, before media bytes).
    packs_per_shard: int = 256
    progress: bool = True
    record_kind: str = "auto"  # data.record_kind: how records become samples (data/record_kinds.py)
    caption_prompt: Optional[str] = None  # data.caption_prompt
    # The parallel.context_parallel_size the packs are for: each sample counted at its length padded
    # to a multiple of 2 x CP, as training pads it, so a pack still fits seq_len after padding.
    context_parallel: int = 1
    # Config overrides on top of the preset, as for train (``data.max_pixels=...``, ``model.vision.*``): the
    # settings the packs' token counts and media geometry follow, which training must share.
    overrides: tuple[str, ...] = ()

    @property
    def sample_multiple(self) -> int:
        return context_sample_multiple(self.context_parallel)


@dataclass
class PackSummary:
    output: Path
    stats: dict
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, this call only
    samples: dict[str, int] = field(default_factory=dict)  # processed per stage, this call only
    workers: int = 1

    def rate(self, stage: str) -> float:
        seconds = self.seconds.get(stage, 0.0)
        return self.samples.get(stage, 0) / seconds if seconds > 0 else 0.0

    def format(self) -> str:
        s = self.stats
        rejects = ", ".join(f"{k} {v}" for k, v in s["rejects_by_reason"].items() if v) or "none"
        padded = f", samples padded to a multiple of {s['sample_multiple']}" if s["sample_multiple"] > 1 else ""
        lines = [f"packed {s['samples_packed']} of {s['samples_in']} samples into {s['packs']} packs "
                 f"of {s['seq_len']} tokens ({s['algorithm']}{padded}): fill ratio {s['fill_ratio']:.4f}",
                 f"rejected {s['samples_rejected']} ({rejects}); see {self.output / 'rejects.jsonl'}"]
        for stage in ("scan", "plan", "write"):
            if stage in self.seconds:
                lines.append(f"{stage}: {self.samples.get(stage, 0)} samples in {self.seconds[stage]:.2f} s "
                             f"({self.rate(stage):.0f} samples/s, {self.workers if stage != 'plan' else 1} "
                             f"worker(s))")
        lines.append(f"output: {self.output}")
        return "\n".join(lines)


def run_pack(options: PackOptions, *, fault: Optional[FaultHook] = None) -> PackSummary:

    _check_options(options)
    cfg = _load_config(options)
    files = [str(p) for p in expand_data_paths(list(options.inputs))]
    sizing = _sizing_dict(cfg)
    config = _folder_config(options, cfg, files, sizing, entry_weights(list(options.inputs)))
    root = Path(options.output)
    _check_folder(root, config, options.resume)
    summary = PackSummary(output=root, stats={}, workers=options.workers)

    start = time.perf_counter()
    samples = ArrowSamples(list(options.inputs), cfg.data.cache_dir, reading=reading_for(cfg.data))
    mixture = build_mixture(list(options.inputs), samples.entry_spans(), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    context = workers.MeasureContext(inputs=tuple(files), data_cfg=cfg.data, model_cfg=cfg.model)
    workers.install(context, samples)
    workers.measurer()  # load the tokenizer once, before workers fork
    if mixture is not None:  # as training does, before the folder is made: an error leaves nothing behind
        check_entries_usable(mixture, source_names(list(options.inputs)), workers.reject_reason, entry="input")
    _prepare_folder(root, config, options.resume)
    with _bar(options, len(samples), "scan") as bar:
        bar.update(len(samples) - _remaining_scan(root, len(samples)))
        summary.samples["scan"] = run_scan(root, len(samples), context, num_workers=options.workers,
                                           on_chunk=_tick(bar, fault, "scan"))
    summary.seconds["scan"] = time.perf_counter() - start

    start = time.perf_counter()
    with _bar(options, len(samples), "plan") as bar:
        records = read_scan(root, len(samples))
        sources = None
        if mixture is not None:
            records, sources = _in_mixture_order(records, mixture, source_names(list(options.inputs)))
        plan = make_plan(records, seq_len=options.seq_len, algorithm=options.algorithm,
                         max_images=options.max_images_per_pack, group_by_media=options.group_by_media,
                         packs_per_shard=options.packs_per_shard, sample_multiple=options.sample_multiple)
        if not (root / MANIFEST_FILE).exists():
            write_plan(root, plan)
        bar.update(len(samples))
    summary.seconds["plan"], summary.samples["plan"] = time.perf_counter() - start, len(plan.accepted)

    start = time.perf_counter()
    with _bar(options, len(plan.accepted), "write") as bar:
        pending = sum(len(members) for _, _, packs in shard_tasks(root, plan) for _, members in packs)
        bar.update(len(plan.accepted) - pending)
        summary.samples["write"] = run_write(root, plan, context, num_workers=options.workers,
                                             on_shard=_tick(bar, fault, "write"))
    summary.seconds["write"] = time.perf_counter() - start

    summary.stats = compute_stats(plan, seq_len=options.seq_len, algorithm=options.algorithm, preset=options.preset,
                                  max_images=options.max_images_per_pack, group_by_media=options.group_by_media,
                                  vision_sizing=sizing, sample_multiple=options.sample_multiple)
    if sources is not None:
        summary.stats["sources"] = sources
    write_atomic(root / STATS_FILE, (json.dumps(summary.stats, indent=2) + "\n").encode())
    _check_some_packs(summary.stats, root)
    return summary


# ---------------------------------------------------------------- helpers


def _check_options(options: PackOptions) -> None:
    problems = []
    if options.algorithm not in ALGORITHMS:
        problems.append(f"--algorithm {options.algorithm!r} is unknown; choose one of {', '.join(ALGORITHMS)}.")
    if options.seq_len < 1:
        problems.append(f"--seq-len must be >= 1, got {options.seq_len}.")
    if options.workers < 1:
        problems.append(f"--workers must be >= 1, got {options.workers}.")
    if options.max_images_per_pack is not None and options.max_images_per_pack < 1:
        problems.append(f"--max-images-per-pack must be >= 1, got {options.max_images_per_pack}.")
    if options.packs_per_shard < 1:
        problems.append(f"--packs-per-shard must be >= 1, got {options.packs_per_shard}.")
    problems += _context_parallel_problems(options)
    if problems:
        raise ConfigError(problems)


def _context_parallel_problems(options: PackOptions) -> list[str]:
    # A sample of at most seq_len tokens padded to the multiple stays within seq_len only when the
    # multiple divides seq_len; training requires it of data.seq_len at that CP too.
    if options.context_parallel < 1:
        return [f"--context-parallel must be >= 1, got {options.context_parallel}."]
    multiple = options.sample_multiple
    if options.seq_len % multiple == 0:
        return []
    below = options.seq_len // multiple * multiple
    return [f"--seq-len {options.seq_len} must be a multiple of {multiple} (2 x --context-parallel "
            f"{options.context_parallel}: every sample is padded to a multiple of it); use {below or multiple} "
            f"or {below + multiple}."]


def _check_some_packs(stats: dict, root: Path) -> None:
    # A folder without packs would fail only later, in training; stats and rejects stay for a look.
    if stats["packs"]:
        return
    reasons = ", ".join(f"{k} {v}" for k, v in stats["rejects_by_reason"].items() if v) or "no samples read"
    raise InputError(f"0 packs written: {stats['samples_rejected']} of {stats['samples_in']} samples rejected "
                     f"({reasons}); see {root / 'rejects.jsonl'}, then fix the inputs or raise --seq-len")


def _load_config(options: PackOptions):
    # The pack's capacity is the training row length: tokenization rejects longer samples.
    settings = {"seq_len": options.seq_len, "record_kind": options.record_kind,
                "caption_prompt": options.caption_prompt}
    return load_run_config(options.preset, overrides=[*options.overrides, *(
        Override(text=f"data.{key}={value}", path=("data", key), delete=False, value=value)
        for key, value in settings.items())])


def _sizing_dict(cfg) -> dict:
    sizing = vision_sizing(cfg.data, cfg.model)
    return {} if sizing is None else sizing.geometry()


def _in_mixture_order(records: list[dict], mixture: Mixture, names: list[str]) -> tuple[list[dict], dict]:
    """The scan records of one block of the mixture's draws, in draw order (a sample drawn twice is
    there twice), then the rejects once each in input order; and per source the samples and tokens
    drawn (a document cut into pieces counts once, its pieces' tokens all)."""
    accepted = defaultdict(list)  # sample index -> its records (one, or one per piece)
    for record in records:
        if "reason" not in record:
            accepted[record["i"]].append(record)
    draws = int(mixture.sizes.sum())
    indices, sources = mixture.indices(0, draws).tolist(), mixture.sources(range(draws)).tolist()
    mixed = [record for index in indices for record in accepted.get(index, ())]
    counts = {name: {"samples": 0, "tokens": 0} for name in names}
    for index, source in zip(indices, sources):
        if index in accepted:
            counts[names[source]]["samples"] += 1
            counts[names[source]]["tokens"] += sum(record["tokens"] for record in accepted[index])
    return mixed + [record for record in records if "reason" in record], counts


def _folder_config(options: PackOptions, cfg, files: list[str], sizing: dict, weights: Optional[list[int]]) -> dict:
    data = cfg.data
    return {
        "format": FORMAT,
        "inputs": [{"path": f, "bytes": Path(f).stat().st_size} for f in files],
        "preset": options.preset,
        "seq_len": options.seq_len,
        "algorithm": options.algorithm,
        "max_images_per_pack": options.max_images_per_pack,
        "group_by_media": options.group_by_media,
        "packs_per_shard": options.packs_per_shard,
        "tokenizer": data.tokenizer,
        "system_prompt": data.system_prompt,
        "video_fps": data.video_fps,
        "video_max_frames": data.video_max_frames,
        "vision_sizing": sizing,
        "tokens": asdict(cfg.model.tokens),
        # Only where set, so folders packed before these settings existed still resume.
        **({"record_kind": data.record_kind} if data.record_kind != "auto" else {}),
        **({"caption_prompt": data.caption_prompt} if data.caption_prompt is not None else {}),
        # A mixture decides which samples the packs hold (loongforge.data.mixture).
        **({"mixture": {"weights": weights, "seed": data.seed, "shuffle": data.shuffle}} if weights else {}),
        **({"sample_multiple": options.sample_multiple} if options.sample_multiple > 1 else {}),
        **({"overrides": list(options.overrides)} if options.overrides else {}),
    }


def _check_folder(root: Path, config: dict, resume: bool) -> None:
    """Refuse ``--output`` before any work: a file, or a folder that ``resume`` may not continue."""
    if root.exists() and not root.is_dir():
        raise InputError(f"--output {root} is a file, not a folder; choose a folder path to write packs into")
    if root.exists() and any(root.iterdir()):
        if not resume:
            raise InputError(f"output folder {root} is not empty; pass --resume to continue the run that "
                             f"wrote it, or choose a new folder")
        config_path = root / CONFIG_FILE
        if not config_path.exists() or config_path.read_text() != _config_text(config):
            raise InputError(f"--resume: {root} was written with other inputs or flags (see {config_path}); "
                             f"rerun with the same ones or pack into a new folder")


def _prepare_folder(root: Path, config: dict, resume: bool) -> None:
    """``root`` ready to write into (checked by ``_check_folder``): a resumed folder without its
    partial files, a new one with ``pack_config.json``."""
    if root.exists() and any(root.iterdir()):
        remove_partial_files(root)
        return
    write_atomic(root / CONFIG_FILE, _config_text(config).encode())


def _config_text(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


def _remaining_scan(root: Path, num_samples: int) -> int:

    size = folder.SCAN_CHUNK
    return sum(min(size, num_samples - c * size) for c in range(num_chunks(num_samples))
               if not folder.scan_part(root, c).exists())


def _bar(options: PackOptions, total: int, stage: str):
    from tqdm import tqdm  # lazy: only a run with progress on draws a bar

    return tqdm(total=total, desc=stage, unit="sample", disable=not options.progress, dynamic_ncols=True)


def _tick(bar, fault: Optional[FaultHook], stage: str):
    def on_unit(unit: int, count: int) -> None:
        bar.update(count)
        if fault is not None:
            fault(stage, unit)
    return on_unit
