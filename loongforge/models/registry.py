"""Model families by name: ``model.family`` in a config selects the builder.

The table holds import paths, not modules, so that importing the registry does not import every
model (and megatron-core) up front.
"""

from __future__ import annotations

import importlib
from typing import Callable

# family -> "module:function" of a builder with build_model's signature
_BUILDERS: dict[str, str] = {
    "qwen2_5_vl": "loongforge.models.qwen2_5_vl.model:build_model",
}


def families() -> list[str]:
    return sorted(_BUILDERS)


def get_builder(family: str) -> Callable:
    """The ``build_model(model_cfg, parallel_cfg, *, params_dtype, pre_process, post_process, device,
    recompute_activations, init_seed)`` of a model family."""
    if family not in _BUILDERS:
        raise ValueError(f"model.family={family!r} is not one of {', '.join(families())}")
    module_name, _, function_name = _BUILDERS[family].partition(":")
    return getattr(importlib.import_module(module_name), function_name)
