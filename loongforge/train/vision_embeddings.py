"""``data.vision_embeddings``: training on ``loongforge encode``'s stored features, checked first.

Before anything is built, the store's ``encoder.json`` is held against this run: its processor
settings (the same pixels) and the digest of this run's encoder weights (the same features). A
mismatch is one line naming both sides. Where this run's encoder weights come from, first match:

1. the checkpoint it resumes or loads, when that run trained on stored features too: its
   ``meta.json`` records the digest it checked (``DIGEST_KEY``);
2. a checkpoint holding the encoder (``checkpoint.load``), or ``checkpoint.load_hf``;
3. the initial weights ``training.seed`` gives (a run from scratch: what ``encode`` without
   weights uses).

Rank 0 builds the encoder for the digest (fp32 on the run's device, on a process group of its own) and every rank
learns the outcome, so a mismatch stops all of them with the same message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from loongforge.config.errors import InputError
from loongforge.config.schema import RunConfig
from loongforge.convert.checkpoint_folders import META_FILE
from loongforge.convert.model_io import build_loaded_encoder
from loongforge.data.embedding_store import EmbeddingStore, processor_settings
from loongforge.models.vlm.fingerprint import weights_digest

# meta.json key of a checkpoint trained on stored features: the encoder digest it was checked with.
DIGEST_KEY = "vision_embeddings_encoder_digest"


def frozen_encoder_note(cfg: RunConfig) -> Optional[str]:
    """The start-up line of a run on stored features that leaves the vision tower or the projector
    trainable: the store holds the projector's outputs, so neither runs nor trains here, and an
    online run with those settings (which trains them) gives other losses. None otherwise."""
    training = cfg.training
    if cfg.data.vision_embeddings is None or (training.freeze_vision and training.freeze_projector):
        return None
    unfrozen = [f"training.{key}=false" for key in ("freeze_vision", "freeze_projector") if not getattr(training, key)]
    return (f"encoder: frozen: data.vision_embeddings holds the projector's outputs, so neither the vision tower "
            f"nor the projector runs or trains here, whatever training.freeze_* say (this run: {', '.join(unfrozen)}); "
            f"the same run with the encoder online trains what they leave unfrozen and gives other losses (compare "
            f"with training.freeze_vision=true training.freeze_projector=true)")


def open_vision_embeddings(cfg: RunConfig, *, load_path: Optional[Path], device) -> tuple[EmbeddingStore, str]:
    """The store, checked against this run (InputError on every rank otherwise), and the digest.
    Collective: every rank calls it."""
    store = EmbeddingStore(cfg.data.vision_embeddings)
    _check_processor(cfg, store)
    recorded, weights, source = _encoder_source(cfg, load_path)
    digest = recorded or _digest_on_rank_zero(cfg, weights, device)
    stored = store.encoder["weights_digest"]
    if digest != stored:
        raise InputError(
            f"data.vision_embeddings={store.root} was encoded with encoder weights {stored[:19]}... "
            f"({store.encoder['weights'] or 'initial weights'}), but this run's encoder is {digest[:19]}... "
            f"({source}); encode again with this run's weights (--checkpoint / --hf) or start from those")
    return store, digest


def _check_processor(cfg: RunConfig, store: EmbeddingStore) -> None:
    ours, theirs = processor_settings(cfg.data, cfg.model), store.encoder["processor"]
    if ours["vision_sizing"].get("video_rule") is None and isinstance(theirs.get("vision_sizing"), dict):
        # A model that takes no videos: the video rule a store recorded for it (older ones recorded one
        # for every model) never applied to its features.
        theirs = {**theirs, "vision_sizing": {**theirs["vision_sizing"], "video_rule": None}}
    if ours != theirs:
        keys = sorted(_differences(ours, theirs))
        raise InputError(f"data.vision_embeddings={store.root} was encoded with other image/video settings "
                         f"({', '.join(keys)}: {_pick(theirs, keys)} there, {_pick(ours, keys)} in this run); "
                         f"encode again with this run's data.* settings, or match them")


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(a) | set(b)):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            keys += _differences(a[key], b[key], f"{prefix}{key}.")
        elif a.get(key) != b.get(key):
            keys.append(prefix + key)
    return keys


def _pick(settings: dict, keys: list[str]) -> dict:
    picked = {}
    for key in keys:
        value = settings
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        picked[key] = value
    return picked


def _encoder_source(cfg: RunConfig, load_path: Optional[Path]) -> tuple[Optional[str], Optional[str], str]:
    """(digest recorded by a checkpoint, or None; weights to build the encoder from, or None for
    the initial ones; where the weights come from, for messages)."""
    if load_path is not None:
        meta_file = Path(load_path) / META_FILE
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        if DIGEST_KEY in meta:
            return meta[DIGEST_KEY], None, f"recorded in {meta_file}"
        return None, str(load_path), f"checkpoint {load_path}"
    if cfg.checkpoint.load_hf:
        return None, cfg.checkpoint.load_hf, f"checkpoint.load_hf={cfg.checkpoint.load_hf}"
    return None, None, f"initial weights of training.seed={cfg.training.seed}"


def _digest_on_rank_zero(cfg: RunConfig, weights: Optional[str], device) -> str:
    """Rank 0 builds the encoder (a process group of its own: ``new_group`` is collective, so every
    rank makes it) and every rank receives the digest, or the InputError loading it raised."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    alone = dist.new_group([0]) if dist.is_initialized() else None
    outcome = [None]
    if not distributed or dist.get_rank() == 0:
        try:
            encoder = build_loaded_encoder(cfg.model, init_seed=cfg.training.seed, device=device,
                                           weights=weights, group=alone)
            outcome = [("digest", weights_digest(encoder))]
        except InputError as exc:
            outcome = [("error", str(exc))]
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise InputError(value)
    return value
