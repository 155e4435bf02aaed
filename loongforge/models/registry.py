"""Model families by name: ``model.family`` in a config selects a ``ModelFamily``.

The only module outside ``loongforge/models/<family>/`` that imports a family folder. Adding a
family is its folder (exporting ``FAMILY``) and one line in ``_FAMILIES``. Families are imported
when first asked for, so that looking one up does not import every model.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Mapping

from loongforge.config.errors import ConfigError, InputError
from loongforge.config.schema import RunConfig
from loongforge.config.validate import family_layout_problems, unbuilt_feature_fields, yaml_text
from loongforge.models import parts
from loongforge.models.family import ANY_TOWER, ModelFamily, registered

# family name -> the package whose FAMILY it is
_FAMILIES: dict[str, str] = {
    "composition": "loongforge.models.composition",
    "ernie4_5_vl": "loongforge.models.ernie4_5_vl",
    "internvl": "loongforge.models.internvl",
    "llava_onevision": "loongforge.models.llava_onevision",
    "llava_onevision1_5": "loongforge.models.llava_onevision1_5",
    "llm": "loongforge.models.llm",
    "qwen2_5_vl": "loongforge.models.qwen2_5_vl",
    "qwen3_5": "loongforge.models.qwen3_5",
    "qwen3_vl": "loongforge.models.qwen3_vl",
}


def families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str, key: str = "model.family") -> ModelFamily:
    """The family ``name``; a one-line ConfigError naming ``key`` (and the nearest name) if unknown."""
    return registered(_FAMILIES, name, key, lambda choices: f"one of {choices}").FAMILY


def check_family_layout(cfg: RunConfig) -> None:
    """``cfg``'s layout against its family's own rule (config loading checks the decoder rule, which
    every family starts from), and its parts (``model.vision.arch``, ``model.projector.arch``)
    against the family's composition; a ConfigError listing each problem."""
    family = get_family(cfg.model.family)
    problems = family_layout_problems(cfg, family.layout)
    composition = parts.composition_problems(cfg.model, family.name, family.vision_part, any_tower=ANY_TOWER)
    problems += composition
    if family.has_vision and not composition:  # the tower's own checks of its settings
        problems += parts.tower(family.tower(cfg.model)).config_problems(cfg.model)
    problems += _rope_problems(cfg, family)
    problems += feature_problems(cfg, family) + family.config_problems(cfg.model)
    if family.hf_model_class is None and cfg.checkpoint.save_hf:
        problems.append(f"checkpoint.save_hf=true: model.family={family.name} has no transformers class, so no HF "
                        "export; set checkpoint.save_hf=false (the loongforge checkpoint resumes at any layout)")
    if problems:
        raise ConfigError(problems)


def feature_problems(cfg: RunConfig, family: ModelFamily) -> list[str]:
    """A field of a layer kind or option the family does not build, set: one line per field, naming the
    families that build it."""
    problems = []
    for feature, name, value, default in unbuilt_feature_fields(cfg, family.features):
        builders = [other for other in families() if feature in get_family(other).features]
        where = f"model.family={' or '.join(builders)} builds it" if builders else "no family builds it yet"
        given = f"model.{name} is set" if dataclasses.is_dataclass(value) else f"model.{name}={yaml_text(value)}"
        problems.append(f"{given} but model.family={family.name} does not build {feature.replace('_', ' ')} ({where}); "
                        f"set model.{name}={yaml_text(default)} or choose such a family.")
    return problems


def _rope_problems(cfg: RunConfig, family: ModelFamily) -> list[str]:
    section = cfg.model.language.mrope_section
    if family.rope == "mrope" and not section:
        return [f"model.language.mrope_section=[]: model.family={family.name} uses M-RoPE; give its three "
                "sections (temporal, height, width rotary pairs)"]
    if family.rope == "rope" and section:
        return [f"model.language.mrope_section={section}: model.family={family.name} uses 1-D RoPE; set it to []"]
    return []


def family_of_hf_config(hf_config: Mapping[str, Any], where: str) -> ModelFamily:
    """The family that reads an HF ``config.json``; InputError naming what was found otherwise."""
    for name in families():
        family = get_family(name)
        if family.reads_hf_config(hf_config):
            return family
    architectures = hf_config.get("architectures") or []
    found = ", ".join(architectures) or f"model_type={hf_config.get('model_type')!r}"
    supported = ", ".join(sorted(a for name in families() for a in get_family(name).hf_architectures))
    raise InputError(f"{where}: unsupported architecture {found}; loongforge convert reads {supported}")
