"""``run_encode``: plan -> encode (1..N processes) -> index, over one resumable output folder.

The folder starts with ``encode_job.json`` (inputs, preset, weights, dtype, process count, shard
size, processor settings: all that decides the output). ``resume=True`` accepts a folder only if
that file matches, removes partial ``*.tmp`` files and skips the shards already on disk; the plan
is recomputed (deterministic), so shards written before a kill and after it belong to one plan.
The index, the rejects and ``encoder.json`` are assembled from the shards' headers at the end,
``encoder.json`` last.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.multiprocessing as mp
from safetensors import safe_open

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.loader import load_run_config, set_keys
from loongforge.convert.hf_architecture import model_from_hf_folder
from loongforge.convert.hf_io import is_hf_folder
from loongforge.data.conversations import expand_data_paths
from loongforge.data.embedding_store import (
    ENCODER_FILE,
    FORMAT,
    INDEX_FILE,
    JOB_FILE,
    REJECTS_FILE,
    RUNS_FILE,
    SHARD_DIR,
    SHARD_METADATA_KEY,
    processor_settings,
    shard_name,
)
from loongforge.data.measure import vision_sizing
from loongforge.data.packfile.folder import CONFIG_FILE as PACK_CONFIG_FILE
from loongforge.data.packfile.folder import json_line, remove_partial_files, write_atomic
from loongforge.data.packfile.reader import PackedFolder
from loongforge.encode.plan import EncodePlan, plan_files, plan_packed
from loongforge.encode.worker import DTYPES, ShardDone, WorkerSpec, default_threads, run_rank
from loongforge.models.registry import get_family
from loongforge.parallel.console import quiet_process
from loongforge.parallel.launch_env import runs_on_cuda
from loongforge.parallel.spawned import run_to_the_end


@dataclass(frozen=True)
class EncodeOptions:
    inputs: tuple[str, ...]
    output: Path
    preset: str
    weights: Optional[str] = None  # HF folder or loongforge checkpoint
    nproc: int = 1
    dtype: str = "bf16"
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    shard_tokens: int = 65536  # output rows per shard: the unit --resume skips
    batch_patches: int = 16384  # patches per encoder call
    overrides: tuple[str, ...] = ()  # config overrides (data.max_pixels=..., model.*)
    progress: bool = True


@dataclass
class EncodeSummary:
    output: Path
    encoder: dict
    seconds: float
    media_this_run: int

    def format(self) -> str:
        counts = self.encoder["counts"]
        rate = self.media_this_run / self.seconds if self.seconds > 0 else 0.0
        rejects = ", ".join(f"{k} {v}" for k, v in counts["rejects_by_reason"].items()) or "none"
        return "\n".join([
            f"encoded {counts['media']} media ({counts['images']} images, {counts['videos']} videos) of "
            f"{counts['samples']} samples: {counts['tokens']} tokens, {counts['bytes'] / 2**20:.1f} MiB "
            f"in {counts['shards']} shards ({self.encoder['dtype']})",
            f"this run: {self.media_this_run} media in {self.seconds:.1f} s ({rate:.1f} media/s, "
            f"{self.encoder['processes']} process(es))",
            f"rejected {counts['rejected_samples']} samples ({rejects}); see {self.output / REJECTS_FILE}",
            f"encoder {self.encoder['weights_digest'][:19]}... from {self.encoder['weights'] or 'initial weights'}",
            f"output: {self.output}",
        ])


def run_encode(options: EncodeOptions, *, on_shard: Optional[ShardDone] = None) -> EncodeSummary:
    _check_options(options)
    cfg = _model_of_weights(load_run_config(options.preset, overrides=list(options.overrides)), options)
    if get_family(cfg.model.family).build_encoder is None:
        raise ConfigError(f"--preset {options.preset}: model family {cfg.model.family} has no vision encoder "
                          f"that runs on its own; encode runs a vision-language preset's encoder (see --list-presets)")
    plan, inputs = _plan(options, cfg)
    root = Path(options.output)
    job = _job_record(options, cfg, inputs)
    _prepare_folder(root, job, options)
    spec = WorkerSpec(cfg=cfg, root=root, plan=plan, world_size=options.nproc, dtype=options.dtype,
                      weights=options.weights, device=options.device, shard_tokens=options.shard_tokens,
                      batch_patches=options.batch_patches, threads=default_threads(options.nproc))
    start = time.perf_counter()
    shard_sizes = _shard_sizes(spec)
    pending = _pending_media(shard_sizes)
    digest = _run_ranks(spec, options, shard_sizes, on_shard)
    seconds = time.perf_counter() - start
    encoder = _finish(root, spec, job, digest)
    with open(root / RUNS_FILE, "a", encoding="utf-8") as log:  # timings: not part of the output proper
        log.write(json_line({"media": pending, "seconds": round(seconds, 3), "processes": options.nproc,
                             "resumed": options.resume}))
    return EncodeSummary(output=root, encoder=encoder, seconds=seconds, media_this_run=pending)


# ---------------------------------------------------------------- planning and the folder


def _model_of_weights(cfg, options: EncodeOptions):
    """``--hf DIR``: the folder's config.json decides the encoder (``convert.hf_architecture``), as
    ``train checkpoint.load_hf=DIR`` does; ``--checkpoint`` and initial weights: the preset's."""
    if not options.weights or not is_hf_folder(Path(options.weights)):
        return cfg
    return model_from_hf_folder(cfg, options.weights, set_keys(options.overrides), setting="--hf")[0]


def _check_options(options: EncodeOptions) -> None:
    problems = []
    if options.dtype not in DTYPES:
        problems.append(f"--dtype {options.dtype!r} is not one of {' | '.join(DTYPES)}; choose one of those.")
    for flag, value in (("--nproc-per-node", options.nproc), ("--shard-tokens", options.shard_tokens),
                        ("--batch-patches", options.batch_patches)):
        if value < 1:
            problems.append(f"{flag} must be >= 1, got {value}.")
    if options.resume and options.overwrite:
        problems.append("--resume and --overwrite exclude each other; pass one.")
    if problems:
        raise ConfigError(problems)


def _plan(options: EncodeOptions, cfg) -> tuple[EncodePlan, list[dict]]:
    """The plan and the inputs it came from (path, bytes), a pack folder or conversation files."""
    sizing = vision_sizing(cfg.data, cfg.model)
    if len(options.inputs) == 1 and (Path(options.inputs[0]) / PACK_CONFIG_FILE).is_file():
        folder = PackedFolder(options.inputs[0])
        folder.check_compatible(cfg.data.seq_len, sizing)
        return plan_packed(folder), [{"path": str(Path(options.inputs[0]).resolve()), "kind": "pack"}]
    files = [str(p) for p in expand_data_paths(list(options.inputs))]
    inputs = [{"path": f, "bytes": Path(f).stat().st_size} for f in files]
    return plan_files(files, sizing, cfg.data), inputs


def _job_record(options: EncodeOptions, cfg, inputs: list[dict]) -> dict:
    return {
        "format": FORMAT,
        "inputs": inputs,
        "preset": options.preset,
        "overrides": list(options.overrides),
        "family": cfg.model.family,
        "weights": str(Path(options.weights).resolve()) if options.weights else None,
        "dtype": options.dtype,
        "processes": options.nproc,
        "shard_tokens": options.shard_tokens,
        "batch_patches": options.batch_patches,
        "processor": processor_settings(cfg.data, cfg.model),
    }


def _prepare_folder(root: Path, job: dict, options: EncodeOptions) -> None:
    text = json.dumps(job, indent=2) + "\n"
    if root.exists() and not root.is_dir():
        raise InputError(f"--output {root} is a file, not a folder; choose a folder path to write embeddings into")
    if root.exists() and any(root.iterdir()):
        if options.overwrite:
            _remove_encode_folder(root)
        elif not options.resume:
            raise InputError(f"output folder {root} is not empty; pass --resume to finish the run that wrote "
                             f"it, --overwrite to start over, or choose a new folder")
        else:
            job_path = root / JOB_FILE
            if not job_path.exists() or job_path.read_text() != text:
                raise InputError(f"--resume: {root} was written with other inputs or flags (see {job_path}); "
                                 f"rerun with the same ones, or pass --overwrite")
            remove_partial_files(root)
            (root / ENCODER_FILE).unlink(missing_ok=True)  # rewritten once every shard is there
            return
    write_atomic(root / JOB_FILE, text.encode())


def _remove_encode_folder(root: Path) -> None:
    """--overwrite: empty a folder, only if an earlier encode wrote it."""
    if not (root / JOB_FILE).is_file():
        raise InputError(f"--overwrite: {root} is not a `loongforge encode` folder (no {JOB_FILE}); "
                         f"refusing to delete it; choose a new folder")
    for path in root.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


# ---------------------------------------------------------------- running the ranks


def _shard_sizes(spec: WorkerSpec) -> dict[Path, int]:
    """Every shard the plan writes (all ranks) -> its media count; computed once per call."""
    merge_unit = spec.cfg.model.projector.spatial_merge_size ** 2
    sizes = {}
    for rank in range(spec.world_size):
        shards = spec.plan.shards(rank, spec.world_size, merge_unit=merge_unit, shard_tokens=spec.shard_tokens)
        sizes.update({spec.root / shard_name(rank, n): len(items) for n, items in enumerate(shards)})
    return sizes


def _pending_media(shard_sizes: dict[Path, int]) -> int:
    """Media in shards not on disk yet."""
    return sum(count for path, count in shard_sizes.items() if not path.exists())


def _run_ranks(spec: WorkerSpec, options: EncodeOptions, shard_sizes: dict[Path, int],
               on_shard: Optional[ShardDone]) -> str:
    from tqdm import tqdm  # lazy: only the parent draws the bar, not the workers that import this module

    total = len(spec.plan.items)
    with tqdm(total=total, initial=total - _pending_media(shard_sizes), desc="encode", unit="media",
              disable=not options.progress,
              dynamic_ncols=True) as bar:
        if spec.world_size == 1:
            return run_rank(spec, 0, _ticker(bar, on_shard))
        return _run_spawned(spec, bar, shard_sizes)


def _ticker(bar, on_shard: Optional[ShardDone]) -> ShardDone:
    def tick(rank: int, number: int, media: int) -> None:
        bar.update(media)
        if on_shard is not None:
            on_shard(rank, number, media)
    return tick


def _run_spawned(spec: WorkerSpec, bar, shard_sizes: dict[Path, int]) -> str:
    """N processes on this node, each writing its shards; the bar follows the shard files."""
    context = mp.get_context("spawn")
    digests = context.Manager().dict()
    processes = [quiet_process(context, _spawned_rank, (spec, rank), inherited=(digests,),
                               on_cuda=runs_on_cuda(spec.device), daemon=True)
                 for rank in range(spec.world_size)]
    run_to_the_end(processes, what="encode process", poll_s=0.5, on_tick=lambda: _refresh(bar, shard_sizes))
    _refresh(bar, shard_sizes)
    return digests[0]


def _spawned_rank(digests, spec: WorkerSpec, rank: int) -> None:
    digests[rank] = run_rank(spec, rank)


def _refresh(bar, shard_sizes: dict[Path, int]) -> None:
    bar.n = bar.total - _pending_media(shard_sizes)
    bar.refresh()


# ---------------------------------------------------------------- the index


def _finish(root: Path, spec: WorkerSpec, job: dict, digest: str) -> dict:
    """index.jsonl, rejects.jsonl and encoder.json from the shards' headers."""
    rows, total_bytes = [], 0
    rejects = {order: reject.to_json() for order, reject in spec.plan.rejects}
    shards = sorted((root / SHARD_DIR).glob("*.safetensors"))
    for path in shards:
        with safe_open(str(path), framework="pt") as handle:
            header = json.loads(handle.metadata()[SHARD_METADATA_KEY])
        total_bytes += path.stat().st_size
        rows += header["rows"]
        for reject in header["rejects"]:  # a sample with two bad media is one reject (its first)
            rejects.setdefault(reject.pop("sample_order"), reject)
    # A sample is stored whole or not at all: training rejects it either way, and the index says so.
    rows = sorted((row for row in rows if row["sample_order"] not in rejects), key=lambda row: row["order"])
    rejects = [rejects[order] for order in sorted(rejects)]
    write_atomic(root / INDEX_FILE, "".join(json_line(row) for row in rows).encode())
    write_atomic(root / REJECTS_FILE, "".join(json_line(r) for r in rejects).encode())
    encoder = {**job, "weights_digest": digest, "counts": _counts(rows, rejects, spec, len(shards), total_bytes)}
    write_atomic(root / ENCODER_FILE, (json.dumps(encoder, indent=2) + "\n").encode())
    return encoder


def _counts(rows: list[dict], rejects: list[dict], spec: WorkerSpec, shards: int, total_bytes: int) -> dict:
    by_reason: dict[str, int] = {}
    for reject in rejects:
        by_reason[reject["reason"]] = by_reason.get(reject["reason"], 0) + 1
    return {
        "samples": spec.plan.samples,
        "rejected_samples": len(rejects),
        "rejects_by_reason": by_reason,
        "media": len(rows),
        "images": sum(row["kind"] == "image" for row in rows),
        "videos": sum(row["kind"] == "video" for row in rows),
        "tokens": sum(row["tokens"] for row in rows),
        "shards": shards,
        "bytes": total_bytes,
    }
