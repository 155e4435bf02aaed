"""Names in a run's checkpoint folder, shared by ``train`` (writes, resumes) and ``convert`` (reads,
writes weights-only checkpoints).

``<root>/step_00000100/`` is one checkpoint; its ``meta.json`` is written last, so a folder
without it is incomplete. ``<root>/latest`` names the newest complete one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import xxhash

from loongforge.data.fingerprint import head_tail_hash

LATEST_FILE = "latest"
META_FILE = "meta.json"
# meta.json "kind" of a weights-only checkpoint (written by `loongforge convert --to mcore`).
MODEL_ONLY_KIND = "model"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_candidates(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, newest first: the one ``latest`` names, then the
    other ``step_*`` folders with a ``meta.json`` by descending step."""
    root = Path(root)
    complete = sorted((p for p in root.glob("step_*") if (p / META_FILE).is_file()), reverse=True)
    marker = root / LATEST_FILE
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named in complete:
            complete = [named] + [p for p in complete if p != named]
    return complete


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None."""
    candidates = checkpoint_candidates(root)
    return candidates[0] if candidates else None


def weights_digest(folder: str | os.PathLike) -> str:
    """A content digest of an HF folder's weights without reading them whole: every *.safetensors
    file's name, size and ends (``data.fingerprint.head_tail_hash``), and config.json's bytes. What
    a LoRA checkpoint records of its base, so a resume on other base weights is refused."""
    folder = Path(folder)
    digest = xxhash.xxh3_128()
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}|{size}|{head_tail_hash(path, size)}\n".encode())
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return digest.hexdigest()


# meta.json of a LoRA run's checkpoint: what its adapters apply to ({"kind": "hf", "path", "digest"} or
# {"kind": "seed", "seed"}) and their settings (rank, alpha, dropout, targets, modules, experts).
LORA_BASE_KEY = "lora_base"
