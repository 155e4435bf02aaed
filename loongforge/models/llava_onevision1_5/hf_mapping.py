"""Weight map between transformers' ``LlavaOnevision15ForConditionalGeneration`` checkpoints and the composed
model: the tower's rows (``towers/rice_vit/hf_mapping.py``) and the shared decoder's (``decoder.hf_mapping``).

Key styles. The Hub's checkpoints hold ``visual.*`` (the tower's own names: ``class_embedding``,
``merger.ln_q``, ``merger.mlp.0``), ``model.layers.*``, ``model.embed_tokens``, ``model.norm`` and ``lm_head``;
transformers renames them to its modules on load (``model.visual.cls_embeddings.*``, ``model.visual.merger.norm``,
``model.language_model.*``) and its ``save_pretrained`` writes the Hub's names back: the style written here.
Read as well: transformers' module names (its state dict), and the ``model.model.*`` a model built from scratch
(not loaded) is saved under by transformers 5.25, which reverses both of its language renamings.
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import Rule, Tensor, rename_prefixes
from loongforge.models.towers.rice_vit.hf_mapping import tower_rules

# Other styles -> the Hub's (the first pair that matches); Hub names match none and stay as they are.
_VISION_MODULES = (("cls_embeddings.", ""), ("merger.norm.", "merger.ln_q."), ("merger.linear_fc1.", "merger.mlp.0."),
                   ("merger.linear_fc2.", "merger.mlp.2."))
_TO_HUB = (
    *((f"{outer}visual.{module}", f"visual.{hub}") for outer in ("model.", "") for module, hub in _VISION_MODULES),
    ("model.visual.", "visual."), ("model.language_model.", "model."), ("model.model.", "model."),
)


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return tower_rules(model_cfg) + language_rules(model_cfg.language)


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys of any style read renamed to the Hub's, the style written here (others kept)."""
    return rename_prefixes(hf_state, _TO_HUB)
