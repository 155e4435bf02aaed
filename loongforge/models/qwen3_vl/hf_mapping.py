"""Weight map between transformers' Qwen3-VL checkpoints and the composed model (``models.vlm``).

One declarative table, ``mapping_rules(model_cfg, vision)``: each ``Rule`` pairs HF key(s) with one
of our keys and a ``Transform`` (``loongforge.models.hf.rules``) that knows both directions. The
language rows are the shared decoder's (``decoder.hf_mapping.language_rules``: Qwen3 q/k norms, no
qkv bias), the vision rows the vision part's (``towers/qwen3_vit/hf_mapping.py``).
``loongforge.models.hf.weights`` walks it.

HF keys come in two styles: Qwen3-VL's own, which its Hub files and transformers 5's state dict and
``save_pretrained`` share (``model.visual.*``, ``model.language_model.*``, ``lm_head``), and the flat
names of Qwen2.5-VL's era (``visual.*``, ``model.layers.*``, ``model.embed_tokens``), which
transformers 5 does not load into Qwen3-VL. Both are read (``to_hub_style``); Qwen3-VL's own is the
style of the rules and the one written. The vision part's rows and the shared decoder's are built flat
and renamed once (``hf_rules.rename_rule``).

A layout that is not a plain copy (the vision part's are in its module): Qwen3-VL-MoE's experts: ``mlp.experts.gate_up_proj`` / ``down_proj`` hold a layer's experts
[E, ...], each expert a megatron ``local_experts.{e}`` pair (``hf_rules.FusedExperts``; the Hub's
files have the two trailing axes swapped relative to transformers 5, and both are read).
"""

from __future__ import annotations

from typing import Mapping, Optional

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import Rule, Tensor, rename_prefixes, rename_rule
from loongforge.models.towers.qwen3_vit.hf_mapping import tower_rules
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig


def mapping_rules(model_cfg: ModelConfig, vision: Optional[Qwen3VisionConfig] = None) -> list[Rule]:
    """The rows: the vision part's (``towers/qwen3_vit/hf_mapping.py``) and the shared decoder's, with
    Qwen3-VL-MoE's experts fused (one gate_up_proj and one down_proj per layer, every expert in each),
    in Qwen3-VL's nested names. ``vision`` defaults to the facts in ``model_cfg``."""
    vision = vision or Qwen3VisionConfig.from_model_cfg(model_cfg)
    rules = tower_rules(vision) + language_rules(model_cfg.language, fused_experts=True)
    return [rename_rule(rule, _FLAT_TO_NESTED) for rule in rules]


# Key styles: flat names -> Qwen3-VL's nested ones (the rules' style); nested names stay as they are.
_FLAT_TO_NESTED = (("model.visual.", "model.visual."), ("model.language_model.", "model.language_model."),
                   ("visual.", "model.visual."), ("model.", "model.language_model."))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return rename_prefixes(hf_state, _FLAT_TO_NESTED)
