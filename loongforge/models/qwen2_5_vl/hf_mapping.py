"""Weight map between transformers' Qwen2.5-VL checkpoints and the composed model (``models.vlm``).

One declarative table, ``mapping_rules(model_cfg)``: the vision part's rows
(``towers/qwen2_5_vit/hf_mapping.py``) and the shared decoder's. Each ``Rule`` pairs HF key(s) with
one of our keys and a ``Transform`` (``loongforge.models.hf.rules``) that knows both directions
(full HF tensors -> this TP rank's shard, and all ranks' shards -> full HF tensors);
``loongforge.models.hf.weights`` walks the table.

HF keys come in two styles: the Hub's (``visual.*``, ``model.layers.*``, ``model.embed_tokens``,
``lm_head``) and newer transformers' (``model.visual.*``, ``model.language_model.*``). Both are
read (``to_hub_style``); the Hub style is written. ``{i}`` in a pattern is a layer index; language
layers are global in HF and local to the pipeline stage in megatron (``layer_offset``).

Layouts that are not a plain copy:
- language ``linear_qkv``: megatron groups the query heads of each key/value group with that
  group's k and v: ``[q(g, 0..r-1), k(g), v(g)]`` for g in groups, r = heads/groups; TP splits
  whole groups (or, with fewer groups than TP ranks, equal contiguous slices of that layout).
- ``linear_fc1`` of SwiGLU MLPs: each TP rank holds ``[gate shard, up shard]``.
- column-parallel weights split along dim 0, row-parallel along dim 1 (their bias is whole).
- vocabulary: rows padded to ``padded_vocab_size`` with zeros, then split along dim 0.
- pre-norms: HF's ``input_layernorm`` / ``norm1`` live in our ``linear_qkv.layer_norm_weight``, and
  ``post_attention_layernorm`` / ``norm2`` in ``linear_fc1.layer_norm_weight`` (the fused names every
  layer backend writes; the older separate names are read too, see ``state_dict_names``).
"""

from __future__ import annotations

from typing import Mapping

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf.rules import Rule, Tensor, rename_prefixes
from loongforge.models.towers.qwen2_5_vit.hf_mapping import tower_rules

# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    return tower_rules(model_cfg) + language_rules(model_cfg.language)


# ---------------------------------------------------------------------------------------------
# Key styles
# ---------------------------------------------------------------------------------------------

_NEW_TO_HUB = (("model.visual.", "visual."), ("model.language_model.", "model."))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename ``model.visual.*`` / ``model.language_model.*`` keys to the Hub's style."""
    return rename_prefixes(hf_state, _NEW_TO_HUB)
