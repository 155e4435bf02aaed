"""ERNIE-4.5-VL's weight map: the vision part's rows (``towers/ernie_vit/hf_mapping.py``) and the decoder's
(``decoder/hf_mapping.py``: its modality-isolated experts as the Hub stores them), in the names
``save_pretrained`` writes (the Hub's): ``model.vision_model.``, ``model.resampler_model.`` (its MLPs'
layers ``0``, ``2``, ``3``), ``model.layers.``; the text experts then the vision experts in one sequence
``mlp.experts.{e}``, the routers transposed (``mlp.gate.weight``, ``mlp.gate.weight_1``) and their biases one
[2, experts] tensor.

``to_hub_style`` reads transformers' module names too (a ``state_dict()``: ``model.vision_tower.``, the
resampler's ``fc1`` / ``fc2`` / ``ln``, ``model.language_model.``, each set's fused experts, routers and
bias under ``mlp.text_moe.`` / ``mlp.vision_moe.``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import Rule
from loongforge.models.towers.ernie_vit.hf_mapping import tower_rules

_RENAMES = (("model.vision_tower.", "model.vision_model."), ("model.language_model.", "model."),
            ("_linear.fc1.", "_linear.0."), ("_linear.fc2.", "_linear.2."), ("_linear.ln.", "_linear.3."))
_SET = re.compile(r"^(?P<layer>.*\.mlp\.)(?P<kind>text_moe|vision_moe)\.(?P<rest>.*)$")


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return tower_rules(model_cfg) + language_rules(model_cfg.language)


def to_hub_style(state: Mapping[str, Any]) -> dict:
    out: dict[str, Any] = {}
    biases: dict[str, dict[str, Any]] = {}
    experts_of_layer: dict[str, int] = {}
    for key, value in state.items():
        for old, new in _RENAMES:
            key = key.replace(old, new)
        found = _SET.match(key)
        if found is None:
            out[key] = value
            continue
        layer, kind, rest = found["layer"], found["kind"], found["rest"]
        if rest == "gate.weight":
            out[layer + ("gate.weight" if kind == "text_moe" else "gate.weight_1")] = value.t()
        elif rest == "gate.moe_statics.e_score_correction_bias":
            biases.setdefault(layer, {})[kind] = value.reshape(-1)
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            experts_of_layer[layer] = value.shape[0]
            _split_experts(out, layer, kind, rest, value)
        else:
            raise KeyError(f"{key}: not a tensor of ERNIE-4.5-VL's expert sets")
    for layer, pair in biases.items():
        out[layer + "moe_statics.e_score_correction_bias"] = torch.stack([pair["text_moe"], pair["vision_moe"]])
    return out


def _split_experts(out: dict, layer: str, kind: str, rest: str, fused) -> None:
    """transformers' fused experts of one set -> the Hub's per expert tensors (the vision set's numbered after
    the text set's)."""
    first = 0 if kind == "text_moe" else fused.shape[0]
    for e, tensor in enumerate(fused):
        prefix = f"{layer}experts.{first + e}."
        if rest == "experts.down_proj":
            out[prefix + "down_proj.weight"] = tensor
        else:
            out[prefix + "gate_proj.weight"], out[prefix + "up_proj.weight"] = tensor.chunk(2, dim=0)
