"""Weight map between transformers' Qwen2.5-VL checkpoints and ``Qwen2_5_VLModel``.

One declarative table, ``mapping_rules(model_cfg)``: each ``Rule`` pairs HF key(s) with one of our
keys and a ``Transform`` (``loongforge.models.hf_rules``) that knows both directions (full HF tensors -> this TP rank's shard, and
all ranks' shards -> full HF tensors). ``hf_to_megatron`` and ``megatron_to_hf`` only walk the table.

HF keys come in two styles: the Hub's (``visual.*``, ``model.layers.*``, ``model.embed_tokens``,
``lm_head``) and newer transformers' (``model.visual.*``, ``model.language_model.*``). Both are
read (``to_hub_style``); the Hub style is written. ``{i}`` in a pattern is a layer index; language
layers are global in HF and local to the pipeline stage in megatron (``layer_offset``).

Layouts that are not a plain copy:
- language ``linear_qkv``: megatron groups the query heads of each key/value group with that
  group's k and v: ``[q(g, 0..r-1), k(g), v(g)]`` for g in groups, r = heads/groups; TP splits
  whole groups (or, with fewer groups than TP ranks, equal contiguous slices of that layout).
- vision ``qkv``: HF stores ``[3, heads, hd]``; megatron wants ``[heads, 3, hd]`` (groups = heads).
- ``linear_fc1`` of SwiGLU MLPs: each TP rank holds ``[gate shard, up shard]``.
- column-parallel weights split along dim 0, row-parallel along dim 1 (their bias is whole).
- vocabulary: rows padded to ``padded_vocab_size`` with zeros, then split along dim 0.
- patch embedding: HF's Conv3d weight [hidden, C, T, p, p] is our Linear [hidden, C*T*p*p].
- pre-norms: HF's ``input_layernorm`` / ``norm1`` live in our ``linear_qkv.layer_norm_weight``, and
  ``post_attention_layernorm`` / ``norm2`` in ``linear_fc1.layer_norm_weight`` (the fused names every
  layer backend writes; the older separate names are read too, see ``state_dict_names``).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional, Sequence

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.hf_rules import (  # noqa: F401  (Transform, Vocab: re-exported for callers of this table)
    LANGUAGE,
    VISION,
    FusedHeadQKV,
    GateUp,
    GroupedQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
    Tensor,
    Transform,
    Vocab,
)
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.state_dict_names import fused_name

# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def mapping_rules(model_cfg: ModelConfig) -> list[Rule]:
    vis, lang = model_cfg.vision, model_cfg.language
    vision_head_dim = vis.hidden_size // vis.num_heads
    conv_shape = (vis.hidden_size, vis.in_channels, vis.temporal_patch_size, vis.patch_size, vis.patch_size)
    rep, col, row, gate_up = Replicated(), Split(0), Split(1), GateUp()
    vqkv = FusedHeadQKV(vis.num_heads, vision_head_dim)

    vb, vl = "visual.blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule(("visual.patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight", PatchEmbedding(conv_shape), VISION),
        Rule((vb + "norm1.weight",), vl + "self_attention.linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "attn.qkv.weight",), vl + "self_attention.linear_qkv.weight", vqkv, VISION),
        Rule((vb + "attn.qkv.bias",), vl + "self_attention.linear_qkv.bias", vqkv, VISION),
        Rule((vb + "attn.proj.weight",), vl + "self_attention.linear_proj.weight", row, VISION),
        Rule((vb + "attn.proj.bias",), vl + "self_attention.linear_proj.bias", rep, VISION),
        Rule((vb + "norm2.weight",), vl + "mlp.linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "mlp.gate_proj.weight", vb + "mlp.up_proj.weight"), vl + "mlp.linear_fc1.weight", gate_up, VISION),
        Rule((vb + "mlp.gate_proj.bias", vb + "mlp.up_proj.bias"), vl + "mlp.linear_fc1.bias", gate_up, VISION),
        Rule((vb + "mlp.down_proj.weight",), vl + "mlp.linear_fc2.weight", row, VISION),
        Rule((vb + "mlp.down_proj.bias",), vl + "mlp.linear_fc2.bias", rep, VISION),
        Rule(("visual.merger.ln_q.weight",), "projector.ln_q.weight", rep, VISION),
        Rule(("visual.merger.mlp.0.weight",), "projector.mlp.linear_fc1.weight", col, VISION),
        Rule(("visual.merger.mlp.0.bias",), "projector.mlp.linear_fc1.bias", col, VISION),
        Rule(("visual.merger.mlp.2.weight",), "projector.mlp.linear_fc2.weight", row, VISION),
        Rule(("visual.merger.mlp.2.bias",), "projector.mlp.linear_fc2.bias", rep, VISION),
    ]
    return rules + language_rules(lang)


# ---------------------------------------------------------------------------------------------
# Key styles and pattern matching
# ---------------------------------------------------------------------------------------------

_NEW_TO_HUB = (("model.visual.", "visual."), ("model.language_model.", "model."))


def to_hub_style(hf_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename ``model.visual.*`` / ``model.language_model.*`` keys to the Hub's style."""
    renamed = {}
    for key, value in hf_state.items():
        for new, hub in _NEW_TO_HUB:
            if key.startswith(new):
                key = hub + key[len(new) :]
                break
        renamed[key] = value
    return renamed


def _regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$")


def _match(rules: Sequence[Rule], key: str) -> tuple[Rule, Optional[int]]:
    """The rule for one of our keys; separate-norm (legacy) names match their fused rule."""
    key = fused_name(key)
    for rule in rules:
        found = _regex(rule.megatron).match(key)
        if found:
            return rule, int(found.group(1)) if found.groups() else None
    raise KeyError(f"no hf_mapping rule for {key!r}")


def _fill(pattern: str, index: Optional[int]) -> str:
    return pattern if index is None else pattern.replace("{i}", str(index))


def _hf_index(rule: Rule, local_index: Optional[int], layer_offset: int) -> Optional[int]:
    """Language layers are numbered per pipeline stage in megatron, globally in HF."""
    if local_index is None or rule.group == VISION:
        return local_index
    return local_index + layer_offset


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    model_cfg: ModelConfig,
    keys: Iterable[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    vision_tp_rank: int = 0,
    vision_tp_size: int = 1,
    layer_offset: int = 0,
) -> dict[str, Tensor]:
    """This rank's shards of our ``keys`` (e.g. ``model.state_dict().keys()``) from an HF state dict.

    ``_extra_state`` keys (megatron's per-layer FP8 metadata) carry no weights and are skipped.
    """
    hf_state = to_hub_style(hf_state)
    rules = mapping_rules(model_cfg)
    out = {}
    for key in keys:
        if key.endswith("_extra_state"):
            continue
        rule, local_index = _match(rules, key)
        index = _hf_index(rule, local_index, layer_offset)
        sources = [_fill(p, index) for p in rule.hf]
        if rule.fallback_hf and sources[0] not in hf_state:
            sources = [rule.fallback_hf]
        missing = [s for s in sources if s not in hf_state]
        if missing:
            raise KeyError(f"{key} needs {missing} from the HF checkpoint")
        rank, size = (vision_tp_rank, vision_tp_size) if rule.group == VISION else (tp_rank, tp_size)
        out[key] = rule.transform.shard([hf_state[s] for s in sources], rank, size).clone()
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    model_cfg: ModelConfig,
    *,
    vision_tp_size: Optional[int] = None,
    layer_offset: int = 0,
) -> dict[str, Tensor]:
    """Hub-style HF tensors from one pipeline stage's state dicts, one per language TP rank.

    Vision tensors are read from the first ``vision_tp_size`` ranks (None: all of them).
    A tied output layer is not written (tied Hub checkpoints have no ``lm_head.weight``).
    """
    rules = mapping_rules(model_cfg)
    vision_tp_size = vision_tp_size or len(shards)
    out = {}
    for key in shards[0]:
        if key.endswith("_extra_state"):
            continue
        rule, local_index = _match(rules, key)
        if rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            continue
        ranks = shards[:vision_tp_size] if rule.group == VISION else shards
        tensors = rule.transform.unshard([shard[key] for shard in ranks])
        index = _hf_index(rule, local_index, layer_offset)
        for pattern, tensor in zip(rule.hf, tensors):
            out[_fill(pattern, index)] = tensor
    return out


def load_hf_state_dict(model: torch.nn.Module, hf_state: Mapping[str, Tensor]) -> None:
    """Load an HF state dict into this rank's ``Qwen2_5_VLModel`` (TP ranks and the pipeline
    layer offset are read from the model's own process groups and layers)."""
    language = model.language_model
    tp_group = language.pg_collection.tp
    vision_group = None if model.vision_model is None else model.vision_model.layers[0].pg_collection.tp
    layers = language.decoder.layers
    converted = hf_to_megatron(
        hf_state,
        model.model_cfg,
        model.state_dict().keys(),
        tp_rank=tp_group.rank(),
        tp_size=tp_group.size(),
        vision_tp_rank=0 if vision_group is None else vision_group.rank(),
        vision_tp_size=1 if vision_group is None else vision_group.size(),
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
    )
    result = model.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load_hf_state_dict: missing {missing}, unexpected {result.unexpected_keys}")
