"""HF weights straight into a built model, and a finished run's checkpoint out as HF.

``loongforge train checkpoint.load_hf=DIR`` and ``checkpoint.save_hf=true`` use these; they share the
mapping table and the readers/writers of ``loongforge convert``, so training from HF weights needs
no separate conversion step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from loongforge.config.errors import InputError
from loongforge.convert.engine import Link, build_links, check_hf_tensors, mcore_to_hf
from loongforge.convert.hf_io import HFCheckpoint
from loongforge.models.hf_rules import VISION


def _stage_links(model_cfg, layer_offset: int) -> dict[str, Link]:
    """This pipeline stage's model state-dict key -> link (language layers renumbered locally).

    A tied model's last stage (PP > 1) keeps its own copy of the embedding as the output layer:
    it is filled from ``model.embed_tokens.weight``.
    """
    untied = dataclasses.replace(model_cfg, language=dataclasses.replace(model_cfg.language, tie_word_embeddings=False))
    by_key = {}
    for link in build_links(untied):
        if link.rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            link = dataclasses.replace(link, hf_keys=(link.rule.fallback_hf,))
        if link.layer is None:
            by_key[link.mcore_key] = link
        else:
            local = link.layer - layer_offset
            by_key[link.mcore_key.replace("layers.", f"layers.{local}.", 1)] = link
    return by_key


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> int:
    """Copy this rank's shards of an HF checkpoint into ``model`` (a ``Qwen2_5_VLModel`` stage),
    one tensor at a time. Returns the number of tensors loaded."""
    model = getattr(model, "module", model)  # DDP wrapper
    checkpoint = HFCheckpoint(Path(hf_dir))
    check_hf_tensors(checkpoint, model.model_cfg, "the run's model config")
    language = model.language_model
    tp = language.pg_collection.tp
    vision_tp = None if model.vision_model is None else model.vision_model.layers[0].pg_collection.tp
    layers = language.decoder.layers
    links = _stage_links(model.model_cfg, layers[0].layer_number - 1 if len(layers) else 0)
    state = model.state_dict(keep_vars=True)
    loaded = 0
    for key, target in state.items():
        if key.endswith("_extra_state"):
            continue
        link = links.get(key)
        if link is None:
            raise InputError(f"{hf_dir}: no HF tensor maps to model parameter {key}")
        group = vision_tp if link.rule.group == VISION else tp
        local = link.rule.transform.shard([checkpoint.load(k) for k in link.hf_keys], group.rank(), group.size())
        if local.shape != target.shape:
            raise InputError(f"{hf_dir}: {link.hf_keys[0]} gives {list(local.shape)} for {key}, "
                             f"the model holds {list(target.shape)}")
        target.copy_(local)
        loaded += 1
    return loaded


def export_hf(model_cfg, step_dir: str | Path, dst: str | Path, *, hf_source: Optional[str] = None,
              progress: bool = False) -> Path:
    """Write ``dst`` (replaced if present) as an HF folder from a ``loongforge train`` checkpoint."""
    mcore_to_hf(Path(step_dir), Path(dst), model_cfg=model_cfg, hf_source=Path(hf_source) if hf_source else None,
                overwrite=True, progress=progress)
    return Path(dst)
