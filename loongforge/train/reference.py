"""The reference model of preference training: built as the policy is, its weights frozen.

Its weights (``preference.reference``):

- an HF folder: read through the ``loongforge convert`` table with this run's ``model.*`` settings, as
  ``checkpoint.load_hf`` reads the policy's;
- null: a copy of the starting weights, taken once the run's start is restored (from
  ``checkpoint.load_hf``, ``checkpoint.load`` or the seeded initialisation). A resumed run's weights
  are no longer the starting ones: it reads ``checkpoint.load_hf`` again, or needs the folder named.

Reference-free losses (simpo, orpo) build none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from loongforge.config.errors import InputError
from loongforge.config.schema import RunConfig
from loongforge.convert.model_io import load_hf_weights
from loongforge.models.registry import get_family

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_reference(cfg: RunConfig, device: torch.device, policy: list, *, fresh_start: bool) -> Optional[list]:
    """The frozen reference model (one chunk, in a list like the policy) or None for a reference-free
    loss; ``policy``: the run's model chunks holding the starting weights when ``fresh_start``."""
    settings = cfg.preference
    if settings is None or not settings.uses_reference:
        return None
    model = get_family(cfg.model.family).build(
        cfg.model, cfg.parallel, params_dtype=_DTYPES[cfg.training.precision], pre_process=True,
        post_process=True, vp_stage=None, device=device, recompute_activations=False, init_seed=cfg.training.seed,
        with_encoder=cfg.data.vision_embeddings is None)
    folder = settings.reference or (None if fresh_start else cfg.checkpoint.load_hf)
    if folder is not None:
        _check_hf_folder(folder, "preference.reference" if settings.reference else "checkpoint.load_hf")
        load_hf_weights(model, folder)
    elif fresh_start:
        model.load_state_dict(getattr(policy[0], "module", policy[0]).state_dict())
    else:
        raise InputError("a resumed preference run cannot copy its starting weights (they have trained); set "
                         "preference.reference to the HF folder it started from (loongforge convert CKPT DIR --to "
                         "hf turns a checkpoint into one)")
    for param in model.parameters():
        param.requires_grad_(False)
    return [model.eval()]


def _check_hf_folder(folder: str, key: str) -> None:
    if not (Path(folder) / "config.json").is_file():
        raise InputError(f"{key}={folder} is not an HF folder (no config.json); convert a loongforge checkpoint "
                         f"with `loongforge convert CKPT DIR --to hf` and set {key}=DIR")
