"""Weight map between transformers' ``LlavaOnevisionForConditionalGeneration`` checkpoints and the
composed model: the vision part's rows (``towers/siglip/hf_mapping.py``: SigLIP, the projector, the
newline) and the shared decoder's under ``model.language_model.`` (``decoder.hf_mapping``).

Key styles: transformers 5 writes ``model.vision_tower.*``, ``model.multi_modal_projector.*``,
``model.image_newline``, ``model.language_model.*`` and ``lm_head.*``, the style written here; the -hf
checkpoints on the Hub were saved before it as ``vision_tower.*``, ``multi_modal_projector.*``,
``image_newline``, ``language_model.model.*`` and ``language_model.lm_head.*``, read through ``to_hub_style``.
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf_rules import Rule, Tensor, rename_prefixes
from loongforge.models.towers.siglip.hf_mapping import tower_rules

LANGUAGE_PREFIX = "model.language_model."


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return tower_rules(model_cfg) + language_rules(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)


_OLD_TO_NEW = (("language_model.model.", LANGUAGE_PREFIX), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
               ("image_newline", "model.image_newline"))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys of the pre-5 -hf checkpoints renamed to the style written here (others are kept)."""
    return rename_prefixes(hf_state, _OLD_TO_NEW)
