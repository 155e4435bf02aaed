"""How many parameters a LoRA configuration trains, by arithmetic over the family's weight map (no
model built): what ``--dry-run`` plans with, and the kinds of linear a ``lora`` section adapts.

Counts follow PEFT's modules: one adapter per HF linear, A [r, K] and B [N, r]; a linear megatron fuses
(q/k/v, gate/up) holds its parts' adapters, so its count is theirs. Per rank the matrices split as
``models.lora`` splits them: column-parallel (qkv, fc1) A whole and B's rows over TP, row-parallel
(proj, fc2) A's columns over TP and B whole; a routed expert's adapters sit whole with their expert.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.config.schema import LoraConfig, ModelConfig
from loongforge.models.hf_rules import FusedExperts, Rule
from loongforge.models.layer_kinds import layer_kind
from loongforge.models.registry import get_family

_WEIGHT = ".weight"
_COLUMN_LINEARS = ("qkv", "fc1")


def chosen_kinds(lora_cfg: LoraConfig) -> set[str]:
    """The ``layer_kinds`` kinds ``lora_cfg`` adapts (``language.qkv``, ``language.expert_fc1``...)."""
    kinds = {f"{tower}.{module}" for tower in lora_cfg.targets for module in lora_cfg.modules}
    if lora_cfg.experts and "language" in lora_cfg.targets:
        kinds |= {f"language.expert_{module}" for module in lora_cfg.modules if module in ("fc1", "fc2")}
    return kinds


@dataclass(frozen=True)
class AdapterParameters:
    total: int  # every adapter of the model
    per_decoder_layer: float  # one rank's share of one language decoder layer's adapters
    vision_and_projector: float  # one rank's share of the vision tower's and projector's adapters


def _fill(pattern: str) -> str:
    return pattern.replace("{i}", "0").replace("{e}", "0")


def _part_shapes(rule: Rule, hf_shapes: dict) -> list[tuple[int, int]]:
    """[out, in] of each HF linear one of our weights holds (one expert's, for experts)."""
    if isinstance(rule.transform, FusedExperts):
        rows, columns = rule.transform.expert_shape
        return [(rows // rule.transform.parts, columns)] * rule.transform.parts
    return [tuple(hf_shapes[_fill(pattern)][:2]) for pattern in rule.hf]


def _adapter_counts(parts: list[tuple[int, int]], column: bool, r: int, split: int) -> tuple[int, float]:
    """(parameters of one linear's adapters, one rank's share at a TP split of ``split``)."""
    columns = parts[0][1]
    rows = sum(out for out, _ in parts)
    whole = r * len(parts) * columns + r * rows
    if column:  # A [P*r, K] on every rank, B [N, r] split by rows
        return whole, r * len(parts) * columns + r * rows / split
    return whole, r * columns / split + r * rows  # A [r, K] split by columns, B [N, r] whole


def adapter_parameters(model_cfg: ModelConfig, lora_cfg: LoraConfig, *, tensor_parallel: int,
                       vision_tensor_parallel: int, expert_parallel: int) -> AdapterParameters:
    family = get_family(model_cfg.family)
    hf_shapes, kinds = family.hf_shapes(model_cfg), chosen_kinds(lora_cfg)
    language_layers = model_cfg.language.num_layers
    total, per_layer, encoder = 0, 0.0, 0.0
    for rule in family.hf_rules(model_cfg):
        kind = layer_kind(_fill(rule.megatron)[: -len(_WEIGHT)]) if rule.megatron.endswith(_WEIGHT) else None
        if kind not in kinds:
            continue
        tower, _, linear = kind.partition(".")
        expert = linear.startswith("expert_")
        split = 1 if expert else (tensor_parallel if tower == "language" else vision_tensor_parallel)
        whole, share = _adapter_counts(_part_shapes(rule, hf_shapes), linear.removeprefix("expert_") in _COLUMN_LINEARS,
                                       lora_cfg.rank, split)
        if expert:
            experts = model_cfg.language.num_experts
            whole, share = whole * experts, share * experts / expert_parallel
        if tower == "language":
            total += whole * language_layers
            per_layer += share
        else:
            blocks = (rule.count or model_cfg.vision.depth) if "{i}" in rule.megatron else 1
            total += whole * blocks
            encoder += share * blocks
    return AdapterParameters(total=total, per_decoder_layer=per_layer, vision_and_projector=encoder)
