"""Weight map between transformers' ``LlavaOnevision15ForConditionalGeneration`` checkpoints and the composed
model: the tower's rows (``towers/rice_vit/hf_mapping.py``) and the shared decoder's (``decoder.hf_mapping``).

Key styles. transformers 5.25's modules are ``model.visual.*`` (``cls_embeddings.*``, ``merger.norm``,
``merger.linear_fc1`` / ``2``) and ``model.language_model.*``; its checkpoint conversion mapping renames on load
and back on save. Written here: the published checkpoints' names, the Hub style, which transformers reads and,
for a model it loaded, writes back: the tower under ``visual.*`` (``visual.class_embedding``,
``visual.merger.ln_q``, ``visual.merger.mlp.0`` / ``.2``) and the language model under ``model.*`` (``model.layers``,
``model.embed_tokens``, ``model.norm``). Read as well: the module names (its state dict) and what
``save_pretrained`` writes for a model it built rather than loaded (the language model under ``model.model.*``).
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import Rule, Tensor, rename_prefixes
from loongforge.models.towers.rice_vit.hf_mapping import tower_rules

# Where the written style keeps the decoder (``lm_head`` stays at the top).
LANGUAGE_PREFIX = "model."

# Other styles -> the written one (the first pair that matches); its own names match none and stay.
_VISION_MODULES = (("cls_embeddings.", ""), ("merger.norm.", "merger.ln_q."), ("merger.linear_fc1.", "merger.mlp.0."),
                   ("merger.linear_fc2.", "merger.mlp.2."))
_TO_WRITTEN = (
    *((f"{outer}visual.{module}", f"visual.{hub}") for outer in ("model.", "") for module, hub in _VISION_MODULES),
    ("model.visual.", "visual."), ("model.language_model.", LANGUAGE_PREFIX), ("model.model.", LANGUAGE_PREFIX),
)


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return tower_rules(model_cfg) + language_rules(model_cfg.language, hf_prefix=LANGUAGE_PREFIX)


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys of any style read renamed to the style written here (others kept)."""
    return rename_prefixes(hf_state, _TO_WRITTEN)
