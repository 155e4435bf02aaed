"""Weight map between transformers' Qwen3-VL checkpoints and ``Qwen3VLModel``.

One declarative table, ``mapping_rules(model_cfg, vision)``: each ``Rule`` pairs HF key(s) with one
of our keys and a ``Transform`` (``loongforge.models.hf_rules``) that knows both directions. The
language rows are the shared decoder's (``decoder.hf_mapping.language_rules``: Qwen3 q/k norms, no
qkv bias); the vision rows are below. ``hf_to_megatron``, ``megatron_to_hf`` and
``load_hf_state_dict`` only walk it.

HF keys come in two styles: transformers 5's state dict (``model.visual.*``,
``model.language_model.*``, ``lm_head``) and the older Hub style (``visual.*``, ``model.layers.*``,
``model.embed_tokens``). Both are read (``to_hub_style``); the rules are written in the Hub style.

Layouts that are not a plain copy:
- vision ``qkv`` [3, heads, hd] -> megatron [heads, 3, hd] (``FusedHeadQKV``);
- patch embedding: HF's Conv3d weight [hidden, C, T, p, p] is our Linear [hidden, C*T*p*p];
- vision pre-norms (LayerNorm, weight and bias): ``norm1`` lives in our
  ``linear_qkv.layer_norm_{weight,bias}``, ``norm2`` in ``linear_fc1.layer_norm_{weight,bias}``;
- mergers: ``linear_fc1`` column-parallel (bias split with it), ``linear_fc2`` row-parallel.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional, Sequence

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.hf_mapping import language_rules
from loongforge.models.hf_rules import (
    VISION,
    FusedHeadQKV,
    PatchEmbedding,
    Replicated,
    Rule,
    Split,
    Tensor,
)
from loongforge.models.qwen3_vl.configs import Qwen3VisionConfig


def _merger_rules(hf: str, ours: str) -> list[Rule]:
    rep, col, row = Replicated(), Split(0), Split(1)
    return [
        Rule((hf + "norm.weight",), ours + "norm.weight", rep, VISION),
        Rule((hf + "norm.bias",), ours + "norm.bias", rep, VISION),
        Rule((hf + "linear_fc1.weight",), ours + "mlp.linear_fc1.weight", col, VISION),
        Rule((hf + "linear_fc1.bias",), ours + "mlp.linear_fc1.bias", col, VISION),
        Rule((hf + "linear_fc2.weight",), ours + "mlp.linear_fc2.weight", row, VISION),
        Rule((hf + "linear_fc2.bias",), ours + "mlp.linear_fc2.bias", rep, VISION),
    ]


def mapping_rules(model_cfg: ModelConfig, vision: Optional[Qwen3VisionConfig] = None) -> list[Rule]:
    """The rows; ``vision`` defaults to the facts in ``model_cfg`` (so this can be a family's
    ``hf_rules(model_cfg)`` once the schema has the Qwen3-VL vision fields)."""
    vision = vision or Qwen3VisionConfig.from_model_cfg(model_cfg)
    conv_shape = (vision.hidden_size, vision.in_channels, vision.temporal_patch_size, vision.patch_size,
                  vision.patch_size)
    rep, col, row = Replicated(), Split(0), Split(1)
    qkv = FusedHeadQKV(vision.num_heads, vision.head_dim)
    vb, vl = "visual.blocks.{i}.", "vision_model.layers.{i}."
    rules = [
        Rule(("visual.patch_embed.proj.weight",), "vision_model.patch_embed.proj.weight",
             PatchEmbedding(conv_shape), VISION),
        Rule(("visual.patch_embed.proj.bias",), "vision_model.patch_embed.proj.bias", rep, VISION),
        Rule(("visual.pos_embed.weight",), "vision_model.pos_embed.weight", rep, VISION),
        Rule((vb + "norm1.weight",), vl + "self_attention.linear_qkv.layer_norm_weight", rep, VISION),
        Rule((vb + "norm1.bias",), vl + "self_attention.linear_qkv.layer_norm_bias", rep, VISION),
        Rule((vb + "attn.qkv.weight",), vl + "self_attention.linear_qkv.weight", qkv, VISION),
        Rule((vb + "attn.qkv.bias",), vl + "self_attention.linear_qkv.bias", qkv, VISION),
        Rule((vb + "attn.proj.weight",), vl + "self_attention.linear_proj.weight", row, VISION),
        Rule((vb + "attn.proj.bias",), vl + "self_attention.linear_proj.bias", rep, VISION),
        Rule((vb + "norm2.weight",), vl + "mlp.linear_fc1.layer_norm_weight", rep, VISION),
        Rule((vb + "norm2.bias",), vl + "mlp.linear_fc1.layer_norm_bias", rep, VISION),
        Rule((vb + "mlp.linear_fc1.weight",), vl + "mlp.linear_fc1.weight", col, VISION),
        Rule((vb + "mlp.linear_fc1.bias",), vl + "mlp.linear_fc1.bias", col, VISION),
        Rule((vb + "mlp.linear_fc2.weight",), vl + "mlp.linear_fc2.weight", row, VISION),
        Rule((vb + "mlp.linear_fc2.bias",), vl + "mlp.linear_fc2.bias", rep, VISION),
    ]
    rules += _merger_rules("visual.merger.", "projector.")
    rules += _merger_rules("visual.deepstack_merger_list.{i}.", "deepstack_projectors.{i}.")
    return rules + language_rules(model_cfg.language)


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
                key = hub + key[len(new):]
                break
        renamed[key] = value
    return renamed


def _match(rules: Sequence[Rule], key: str) -> tuple[Rule, Optional[int]]:
    for rule in rules:
        found = re.fullmatch(re.escape(rule.megatron).replace(r"\{i\}", r"(\d+)"), key)
        if found:
            return rule, int(found.group(1)) if found.groups() else None
    raise KeyError(f"no Qwen3-VL hf_mapping rule for {key!r}")


def _fill(pattern: str, index: Optional[int]) -> str:
    return pattern if index is None else pattern.replace("{i}", str(index))


def _hf_index(rule: Rule, local_index: Optional[int], layer_offset: int) -> Optional[int]:
    """Language layers are numbered per pipeline stage here, globally in HF."""
    if local_index is None or rule.group == VISION:
        return local_index
    return local_index + layer_offset


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    model_cfg: ModelConfig,
    vision: Qwen3VisionConfig,
    keys: Iterable[str],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
) -> dict[str, Tensor]:
    """This rank's shards of our ``keys`` (e.g. ``model.state_dict().keys()``) from an HF state
    dict. Language layers are global in HF and local to the pipeline stage here (``layer_offset``);
    ``_extra_state`` keys carry no weights and are skipped."""
    hf_state = to_hub_style(hf_state)
    rules = mapping_rules(model_cfg, vision)
    out = {}
    for key in keys:
        if key.endswith("_extra_state"):
            continue
        rule, local_index = _match(rules, key)
        sources = [_fill(p, _hf_index(rule, local_index, layer_offset)) for p in rule.hf]
        if rule.fallback_hf and sources[0] not in hf_state:
            sources = [rule.fallback_hf]
        missing = [s for s in sources if s not in hf_state]
        if missing:
            raise KeyError(f"{key} needs {missing} from the HF checkpoint")
        out[key] = rule.transform.shard([hf_state[s] for s in sources], tp_rank, tp_size).clone()
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    model_cfg: ModelConfig,
    vision: Qwen3VisionConfig,
    *,
    layer_offset: int = 0,
) -> dict[str, Tensor]:
    """Hub-style HF tensors from one pipeline stage's state dicts, one per TP rank. A tied output
    layer is not written (tied checkpoints have no ``lm_head.weight``)."""
    rules = mapping_rules(model_cfg, vision)
    out = {}
    for key in shards[0]:
        if key.endswith("_extra_state"):
            continue
        rule, local_index = _match(rules, key)
        if rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            continue
        tensors = rule.transform.unshard([shard[key] for shard in shards])
        for pattern, tensor in zip(rule.hf, tensors):
            out[_fill(pattern, _hf_index(rule, local_index, layer_offset))] = tensor
    return out


def load_hf_state_dict(model: torch.nn.Module, hf_state: Mapping[str, Tensor]) -> None:
    """Load an HF state dict into this rank's ``Qwen3VLModel`` (TP rank and the pipeline layer
    offset are read from the model's own process groups and layers)."""
    language = model.language_model
    tp_group = language.pg_collection.tp
    layers = language.decoder.layers
    converted = hf_to_megatron(
        hf_state, model.model_cfg, model.vision, model.state_dict().keys(),
        tp_rank=tp_group.rank(), tp_size=tp_group.size(),
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
    )
    result = model.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load_hf_state_dict: missing {missing}, unexpected {result.unexpected_keys}")
