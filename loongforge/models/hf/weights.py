"""HF state dicts <-> one rank's megatron state dict, for any family: walks the family's weight map.

The map is ``ModelFamily.hf_rules`` (``Rule`` rows, ``loongforge.models.hf.rules``); keys in any
style the family reads are first renamed to the Hub style (``ModelFamily.to_hub_style``). ``{i}`` in
a pattern is a layer index; language layers are global in HF and local to the pipeline stage in
megatron (``layer_offset``). ``{e}`` is an expert index (mixture-of-experts layers): global in HF,
local to the expert-parallel rank in megatron (``ExpertPlacement.offset``); experts are split by the expert
TP size, everything else of the language model by TP. A rule whose HF tensor holds every expert of
a layer (``Rule.fuses_experts``) fills our ``{e}`` keys from that one tensor's slices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.hf.rules import VISION, Rule, Tensor
from loongforge.models.registry import get_family
from loongforge.models.hf.state_dict_names import fused_name, is_adapter_key


def _regex(pattern: str) -> re.Pattern:
    escaped = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(escaped + "$")


def _match(rules: Sequence[Rule], key: str, layer_offset: int = 0) -> tuple[Rule, Optional[int], Optional[int]]:
    """The rule for one of our keys, with its layer and expert indices; a key no rule names
    matches by its fused-norm name (separate-norm, legacy, names match their fused rule). A language rule of
    some layers (``Rule.layers``) matches only theirs (``layer_offset``: the stage's first global layer), so
    two layer kinds whose tensors share a name but not a shape (MiMo-V2-Flash's) each find their own."""
    for candidate in dict.fromkeys((key, fused_name(key))):
        for rule in rules:
            found = _regex(rule.megatron).match(candidate)
            if found:
                indices = found.groupdict()
                layer, expert = indices.get("i"), indices.get("e")
                if (layer is not None and rule.layers is not None and rule.group != VISION
                        and int(layer) + layer_offset not in rule.layers):
                    continue
                return rule, None if layer is None else int(layer), None if expert is None else int(expert)
    raise KeyError(f"no hf_mapping rule for {fused_name(key)!r}")


match_rule = _match  # for maps built on the family's (models.layers.lora's adapters)


def _fill(pattern: str, index: Optional[int], expert: Optional[int] = None) -> str:
    pattern = pattern if index is None else pattern.replace("{i}", str(index))
    return pattern if expert is None else pattern.replace("{e}", str(expert))


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
    experts: Optional[ExpertPlacement] = None,
    rules: Optional[Sequence[Rule]] = None,
) -> dict[str, Tensor]:
    """This rank's shards of our ``keys`` (e.g. ``model.state_dict().keys()``) from an HF state dict.
    ``experts``: where this rank's experts sit (``expert_placement``); None: every expert, at TP.
    ``rules``: the map to walk (default: the family's weight map; ``models.layers.lora_params.lora_rules``: the
    adapters').

    ``_extra_state`` keys (megatron's per-layer FP8 metadata) carry no weights and are skipped.
    """
    family = get_family(model_cfg.family)
    hf_state = family.to_hub_style(hf_state)
    rules = family.hf_rules(model_cfg) if rules is None else rules
    out = {}
    for key in keys:
        if key.endswith("_extra_state"):
            continue
        rule, local_index, local_expert = _match(rules, key, layer_offset)
        index = _hf_index(rule, local_index, layer_offset)
        expert = None if local_expert is None else local_expert + (experts.offset if experts else 0)
        sources = [_fill(p, index, None if expert is None else expert + rule.expert_offset) for p in rule.hf]
        if rule.fallback_hf and sources[0] not in hf_state:
            sources = [rule.fallback_hf]
        missing = [s for s in sources if s not in hf_state]
        if missing:
            raise KeyError(f"{key} needs {missing} from the HF checkpoint")
        if rule.group == VISION:
            rank, size = vision_tp_rank, vision_tp_size
        elif expert is not None and experts is not None:
            rank, size = experts.tp_rank, experts.tp_size
        else:
            rank, size = tp_rank, tp_size
        hf = [hf_state[s] for s in sources]
        if rule.fuses_experts:
            out[key] = rule.transform.shard_expert(hf, expert, rank, size).clone()
        else:
            out[key] = rule.transform.shard(hf, rank, size).clone()
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    model_cfg: ModelConfig,
    *,
    vision_tp_size: Optional[int] = None,
    layer_offset: int = 0,
    rules: Optional[Sequence[Rule]] = None,
) -> dict[str, Tensor]:
    """Hub-style HF tensors from one pipeline stage's state dicts, one per language TP rank.

    Vision tensors are read from the first ``vision_tp_size`` ranks (None: all of them).
    A tied output layer is not written (tied Hub checkpoints have no ``lm_head.weight``).
    ``rules``: the map to walk (default: the family's weight map, LoRA adapters' keys skipped;
    ``models.layers.lora_params.lora_rules``: the adapters' map, which writes PEFT's tensors and skips the rest).
    """
    adapters_only = rules is not None
    rules = get_family(model_cfg.family).hf_rules(model_cfg) if rules is None else rules
    vision_tp_size = vision_tp_size or len(shards)
    out = {}
    # (HF key, rule) -> expert -> that expert's tensor on every TP rank, for HF tensors of all experts
    fused: dict[tuple[str, Rule], dict[int, list[Tensor]]] = {}
    for key in shards[0]:
        if key.endswith("_extra_state") or is_adapter_key(key) != adapters_only:
            continue
        rule, local_index, expert = _match(rules, key, layer_offset)
        if rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            continue
        ranks = shards[:vision_tp_size] if rule.group == VISION else shards
        index = _hf_index(rule, local_index, layer_offset)
        if rule.fuses_experts:
            fused.setdefault((_fill(rule.hf[0], index), rule), {})[expert] = [shard[key] for shard in ranks]
            continue
        tensors = rule.transform.unshard([shard[key] for shard in ranks])
        for pattern, tensor in zip(rule.hf, tensors):
            out[_fill(pattern, index, None if expert is None else expert + rule.expert_offset)] = tensor
    for (hf_key, rule), experts in fused.items():
        (out[hf_key],) = rule.transform.unshard_experts([experts[e] for e in sorted(experts)])
    return out


def load_hf_state_dict(model: torch.nn.Module, hf_state: Mapping[str, Tensor],
                       rules: Optional[Sequence[Rule]] = None) -> None:
    """Load an HF state dict into this rank's model of any family (TP ranks and the pipeline
    layer offset are read from the model's own process groups and layers). ``rules``: None loads the
    base model through the family's weight map (LoRA adapters keep their values: they are not in an
    HF checkpoint); ``models.layers.lora_params.lora_rules`` loads PEFT's adapter tensors into the adapters alone."""
    language = model.language_model
    tp_group = language.pg_collection.tp
    vision_group = vision_tp_group(model)
    layers = language.decoder.layers
    adapters_only = rules is not None
    converted = hf_to_megatron(
        hf_state,
        model.model_cfg,
        [key for key in model.state_dict() if is_adapter_key(key) == adapters_only],
        tp_rank=tp_group.rank(),
        tp_size=tp_group.size(),
        vision_tp_rank=0 if vision_group is None else vision_group.rank(),
        vision_tp_size=1 if vision_group is None else vision_group.size(),
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
        experts=expert_placement(expert_layers(language)),
        rules=rules,
    )
    result = model.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and is_adapter_key(k) == adapters_only]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load_hf_state_dict: missing {missing}, unexpected {result.unexpected_keys}")


@dataclass(frozen=True)
class ExpertPlacement:
    """Where this rank's experts sit: the global index of its first, and the expert TP group."""

    offset: int
    tp_rank: int
    tp_size: int


def expert_layers(language_model) -> list:
    """The decoder layers of a language model stage, then its multi-token-prediction layers' (where experts are)."""
    mtp = [layer.transformer_layer for layer in language_model.mtp.layers] if getattr(
        language_model, "mtp_process", False) else []
    return [*language_model.decoder.layers, *mtp]


def expert_placement(layers) -> Optional[ExpertPlacement]:
    """This rank's experts in ``layers`` (a decoder's, and multi-token prediction's decoder layers); None for a
    dense model or a stage without experts (DeepSeek's first layers are dense: the first sparse layer's)."""
    # A modality-isolated layer's text and vision sets are placed alike (``decoder.modality_moe``).
    experts = next((found for found in (getattr(getattr(layer.mlp, "text_moe", layer.mlp), "experts", None)
                                        for layer in layers) if found is not None), None)
    if experts is None:
        return None
    return ExpertPlacement(offset=experts.ep_group.rank() * experts.num_local_experts,
                           tp_rank=experts.tp_group.rank(), tp_size=experts.tp_group.size())


def vision_tp_group(model: torch.nn.Module):
    """The process group the model's vision tower is tensor-parallel over; None without a tower
    on this rank (a text-only model, a later pipeline stage)."""
    tower = getattr(model, "vision_model", None)
    return None if tower is None else tower.layers[0].pg_collection.tp
