"""Weight map between transformers' Qwen3.5 checkpoints and the composed model (``models.vlm``): the
vision part's rows (``towers/qwen3_vit``, no DeepStack mergers) and the shared decoder's, whose hybrid
rows give each full-attention layer its gated attention (``hf_rules.GatedGroupedQKV``) and each
linear-attention layer its Gated DeltaNet (``models.decoder.gated_delta_net``'s key-head-grouped projection and
convolution, ``hf_rules.GroupedRows``).

HF keys: Qwen3.5's nested style (``model.visual.*``, ``model.language_model.*``, ``lm_head``), which its
Hub files, transformers' state dict and ``save_pretrained`` share; flat names (``visual.*``,
``model.layers.*``) are read too (``to_hub_style``). The Hub checkpoints' multi-token-prediction head
(``mtp.*``) has no place in this model and is not read. Qwen3.5-MoE's Hub files hold one tensor per expert
and projection (``mlp.experts.{e}.gate_proj.weight``), which transformers fuses as it loads; a fused state
dict is split back (``to_hub_style``). The shared expert and its gate map to megatron's ``SharedExpertMLP``.
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import hub_experts, language_rules
from loongforge.models.hf.rules import Rule, Tensor, rename_prefixes, rename_rule
from loongforge.models.towers.qwen3_vit.hf_mapping import tower_rules
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig

# Key styles: flat names -> Qwen3.5's nested ones (the rules' style); nested names stay as they are.
_FLAT_TO_NESTED = (("model.visual.", "model.visual."), ("model.language_model.", "model.language_model."),
                   ("visual.", "model.visual."), ("model.", "model.language_model."))


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    rules = tower_rules(Qwen3VisionConfig.from_model_cfg(model_cfg)) + language_rules(model_cfg.language)
    return [rename_rule(rule, _FLAT_TO_NESTED) for rule in rules]


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Nested names, and transformers 5's fused experts (``experts.gate_up_proj``) split into the Hub's one
    tensor per expert and projection."""
    return hub_experts(rename_prefixes(hf_state, _FLAT_TO_NESTED))
