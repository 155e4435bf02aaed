"""The parameter-count concern, over every shipped preset of every family with a transformers class: the
count by arithmetic (``ModelFamily.count_parameters``) equals transformers' own class built on the meta
device from the config.json loongforge writes for the preset, part by part (the vision tower, the projector
where transformers keeps it apart, the active parameters of a mixture of experts), the published total
where the preset states one (``model.reference_num_params``), and the HF tensor shapes the family expects
(``ModelFamily.hf_shapes``) are the ones transformers builds; the family reads the config.json back as the
preset's model. A new family gets it by shipping presets.

(The ``-small-vocab`` and ``-lora`` presets are their base preset's model with another vocabulary or with
adapters; the composition has no transformers class: ``tests/train/test_composition_train.py`` counts it.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loongforge.config.loader import load_run_config
from loongforge.config.presets import list_preset_names
from loongforge.convert import families
from loongforge.models.decoder.params import mtp_layer_parameters
from loongforge.models.registry import get_family


def _presets() -> list[str]:
    names = []
    for name in list_preset_names():
        if name.endswith(("-small-vocab", "-lora")):
            continue
        if get_family(load_run_config(name).model.family).hf_model_class is not None:
            names.append(name)
    return names


def _meta_model(family, model_cfg):
    """transformers' class of the family, on the meta device, from the config.json loongforge writes (which
    the family reads back as the same model)."""
    import transformers

    hf_dict = family.config_to_hf(model_cfg)
    assert families.config_differences(model_cfg, family.config_from_hf(hf_dict, "config.json")) == []
    config = transformers.AutoConfig.for_model(**hf_dict)
    model_class = getattr(transformers, family.hf_model_class)
    with torch.device("meta"):
        return model_class.from_config(config) if model_class.__name__.startswith("Auto") else model_class(config)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _idle_expert_parameters(model, model_cfg) -> int:
    """Parameters of the routed experts a token does not run through: (experts - top k) / experts of every
    sparse layer's experts (transformers names them ``.experts.``, fused or one module each)."""
    lang = model_cfg.language
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return experts * (lang.moe.num_experts - lang.moe.router_topk) // lang.moe.num_experts


@pytest.mark.parametrize("name", _presets())
def test_counts_equal_transformers_on_the_meta_device(name):
    """A preset with multi-token-prediction layers (DeepSeek-V3.2's) is compared without them, as transformers' classes
    hold none; its published total counts them (``mtp_layer_parameters``)."""
    model_cfg = load_run_config(name).model
    family = get_family(model_cfg.family)
    lang = model_cfg.language
    mtp = lang.mtp_num_layers * mtp_layer_parameters(lang)
    published = family.count_parameters(model_cfg)["total"]
    model_cfg = dataclasses.replace(model_cfg, language=dataclasses.replace(lang, mtp_num_layers=0))
    model = _meta_model(family, model_cfg)
    counts = family.count_parameters(model_cfg)
    total = _numel(model)
    assert published == counts["total"] + mtp
    print(f"\n{name}: transformers {total:,}, loongforge {counts['total']:,} (vision {counts['vision_model']:,}, "
          f"projector {counts['projector']:,}, active {counts['active']:,})")
    assert counts["total"] == total
    if model_cfg.reference_num_params is not None:
        assert published == model_cfg.reference_num_params
    if family.has_vision:
        tower = getattr(model.model, "vision_tower", None) or model.model.visual
        merger = getattr(tower, "merger", None)  # Qwen's merger sits inside its tower: loongforge's projector
        assert counts["vision_model"] + (counts["projector"] if merger else 0) == _numel(tower)
    idle = _idle_expert_parameters(model, model_cfg) if model_cfg.language.moe else 0
    assert counts["active"] == counts["total"] - idle
    shapes = {key: tuple(value.shape) for key, value in family.to_hub_style(model.state_dict()).items()}
    if model_cfg.language.tie_word_embeddings:
        shapes = {key: shape for key, shape in shapes.items() if not key.endswith("lm_head.weight")}
    assert family.hf_shapes(model_cfg) == shapes
