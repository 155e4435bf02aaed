"""Weight map between transformers' ``LlavaOnevisionForConditionalGeneration`` checkpoints and the
composed model: the vision part's rows (``towers/siglip/hf_mapping.py``: SigLIP, the projector), the
anyres packing's newline and the shared decoder's (``decoder.hf_mapping``), built under transformers' module names and
written under the Hub's.

Key styles: the -hf checkpoints on the Hub hold ``vision_tower.*``, ``multi_modal_projector.*``,
``image_newline``, ``language_model.model.*`` and ``language_model.lm_head.*``, and transformers 5's
``save_pretrained`` writes the same names (its checkpoint conversion mapping renames them to its modules
on load and back on save): the style written here, so that HF -> megatron -> HF gives back the files that
were read. transformers 5's module names (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
``model.image_newline``, ``model.language_model.*``, ``lm_head.*``: its state dict) are read too, through
``to_hub_style``.
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import VISION, Replicated, Rule, Tensor, rename_prefixes, rename_rule
from loongforge.models.towers.siglip.hf_mapping import tower_rules

# Where transformers' module tree puts the decoder (the rows are built there, then renamed).
LANGUAGE_PREFIX = "model.language_model."

NEWLINE = "model.image_newline"  # the packing's newline vector, in transformers' module names

# transformers' module names -> the Hub's; Hub names match no pair and stay as they are.
_MODULE_TO_HUB = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                  ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
                  ("model.image_newline", "image_newline"))


def vision_rules(model_cfg: ModelConfig) -> list[Rule]:
    """The vision part's rows: SigLIP's and the projector's, then the newline (vision TP, replicated)."""
    return tower_rules(model_cfg) + [Rule((NEWLINE,), "image_newline.weight", Replicated(), VISION)]


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    rules = vision_rules(model_cfg) + language_rules(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)
    return [rename_rule(rule, _MODULE_TO_HUB) for rule in rules]


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys under transformers' module names renamed to the Hub's, the style written here (others kept)."""
    return rename_prefixes(hf_state, _MODULE_TO_HUB)
