"""``checkpoint.load_hf`` (and ``encode --hf``): the HF folder's ``config.json`` decides the model's architecture.

A preset names a model; a folder holds one. A run used to build the preset's model and check only the
tensor shapes against the folder's, so a Qwen2.5-VL folder of the preset's widths with another
``rope_theta``, vision window or full-attention blocks trained without a word as the preset's model,
and its export wrote the preset's values back: a silently different model.

Now the family reads the folder (``ModelFamily.config_from_hf``) and that is the model. The preset
(and the user's settings) supply parallelism, data and training, and of the model only what
``config.json`` cannot say (the layer backend, the chat format, ...: the fields a family's HF config
does not carry, found by sending the preset's model through ``config_to_hf`` and back). An explicit
``model.*`` setting that contradicts the folder stops in one line naming both values.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from loongforge.config.errors import InputError
from loongforge.config.loader import to_dict
from loongforge.config.schema import ModelConfig, RunConfig
from loongforge.config.validate import validate_tree
from loongforge.models.registry import family_of_hf_config, get_family


def model_from_hf_folder(cfg: RunConfig, folder: str | Path, explicit_keys: Iterable[str],
                         *, setting: str = "checkpoint.load_hf") -> tuple[RunConfig, list[str]]:
    """``cfg`` with the model of ``folder``'s ``config.json``, re-validated, and the
    ``model.* preset -> folder`` changes (for the console). ``explicit_keys``: dotted keys the user
    set (command line, config file): a ``model.*`` one the folder contradicts is an InputError.
    ``setting``: what named the folder (``checkpoint.load_hf``, ``encode --hf``), for messages."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise InputError(f"{setting}={folder}: no config.json there; pass an HF model folder "
                         f"(config.json + *.safetensors)")
    hf_config = json.loads(config_file.read_text())
    family = get_family(cfg.model.family)
    found = family_of_hf_config(hf_config, str(config_file))
    if found.name != family.name:
        raise InputError(f"{config_file}: describes a model of model.family={found.name} "
                         f"({', '.join(hf_config.get('architectures') or [])}), this run's is "
                         f"model.family={family.name}; start from a preset of that family")
    preset_model = _leaves(cfg.model, "model")
    folder_cfg = family.config_from_hf(hf_config, str(config_file))
    unsaid = _fields_hf_cannot_carry(family, cfg.model)
    model = {key: preset_model[key] if key in unsaid else value for key, value in _leaves(folder_cfg, "model").items()}
    _check_explicit(preset_model, model, explicit_keys, config_file, setting)
    changes = [f"{key} {preset_model[key]} -> {value}" for key, value in model.items()
               if preset_model.get(key) != value]
    if changes:  # the preset's published count is another model's
        model["model.reference_num_params"] = None
    tree = to_dict(cfg)
    tree["model"] = dataclasses.asdict(_rebuilt(folder_cfg, model))
    return validate_tree(tree), changes


def _fields_hf_cannot_carry(family, model_cfg: ModelConfig) -> set[str]:
    """Dotted model keys an HF config.json does not carry: those that come back from it changed."""
    carried = _leaves(family.config_from_hf(family.config_to_hf(model_cfg), "the preset's model"), "model")
    return {key for key, value in _leaves(model_cfg, "model").items() if carried.get(key) != value}


def _check_explicit(preset_model: dict, model: dict, explicit_keys: Iterable[str], config_file: Path,
                    setting: str) -> None:
    for key in explicit_keys:
        for leaf in (k for k in model if k == key or k.startswith(f"{key}.")):
            if model[leaf] != preset_model[leaf]:
                raise InputError(f"{leaf}={preset_model[leaf]} contradicts {config_file} ({model[leaf]}): with "
                                 f"{setting} the folder's config.json decides the architecture; drop the "
                                 f"setting, or start from a folder of that model")


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    """Dotted key -> value of every field of a (nested) config dataclass."""
    return dict(_walk(value, prefix))


def _walk(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{prefix}.{f.name}")
    else:
        yield prefix, value


def _rebuilt(template: Any, leaves: dict[str, Any], prefix: str = "model") -> Any:
    """``template`` (a config dataclass) with each leaf ``leaves`` holds replaced."""
    if not dataclasses.is_dataclass(template):
        return leaves.get(prefix, template)
    return dataclasses.replace(template, **{f.name: _rebuilt(getattr(template, f.name), leaves, f"{prefix}.{f.name}")
                                            for f in dataclasses.fields(template) if f.init})
