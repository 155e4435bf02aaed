"""How many parameters a LoRA configuration trains, by arithmetic over the family's weight map (no
model built): what ``--dry-run`` plans with, and the kinds of linear a ``lora`` section adapts.

Counts follow PEFT's modules: one adapter per HF linear, A [r, K] and B [N, r]; a linear megatron fuses
(q/k/v, gate/up) holds its parts' adapters, so its count is theirs. Per rank the matrices split as
``models.layers.lora`` splits them: column-parallel (qkv, fc1) A whole and B's rows over TP, row-parallel
(proj, fc2) A's columns over TP and B whole; a routed expert's adapters sit whole with their expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from loongforge.config.schema import LoraConfig, ModelConfig
from loongforge.models.hf.rules import FusedExperts, Replicated, Rule, Split, Transform
from loongforge.models.layers.layer_kinds import layer_kind
from loongforge.models.registry import get_family
from loongforge.models.hf.state_dict_names import LORA_A, LORA_B

_WEIGHT = ".weight"
_COLUMN_LINEARS = ("qkv", "fc1")


def chosen_kinds(lora_cfg: LoraConfig) -> set[str]:
    """The ``layer_kinds`` kinds ``lora_cfg`` adapts (``language.qkv``, ``language.expert_fc1``...)."""
    kinds = {f"{tower}.{module}" for tower in lora_cfg.targets for module in lora_cfg.modules}
    if lora_cfg.experts and "language" in lora_cfg.targets:
        kinds |= {f"language.expert_{module}" for module in lora_cfg.modules if module in ("fc1", "fc2")}
    return kinds


def per_expert_transform(transform: Transform) -> Transform:
    """How one expert's weight is split (a fused-experts rule's per-expert transform), else ``transform``."""
    return transform.per_expert if isinstance(transform, FusedExperts) else transform


def is_column_rule(rule: Rule) -> bool:
    """A linear's weight rule splits its rows (column-parallel) unless it splits its columns."""
    transform = per_expert_transform(rule.transform)
    return not (isinstance(transform, Split) and transform.dim == 1)


def part_rows(rule: Rule, hf_shapes: dict) -> list[int]:
    """Output rows of each HF linear a (column-parallel) weight fuses: [q, k, v], [gate, up], [N]."""
    if isinstance(rule.transform, FusedExperts):
        rows = rule.transform.expert_shape[0] // rule.transform.parts
        return [rows] * rule.transform.parts
    return [hf_shapes[_fill(pattern, rule)][0] for pattern in rule.hf]


def row_parts(rule: Rule, hf_shapes: dict, rank: int, size: int) -> torch.Tensor | None:
    """[N / size]: the fused part each output row of TP rank ``rank``'s weight shard belongs to, laid
    out and split as the weight's rows are (None: a single part). ``size`` 1: the whole weight, as
    checkpoints store it."""
    rows = part_rows(rule, hf_shapes)
    if len(rows) == 1:
        return None
    parts = [torch.full((count, 1), part) for part, count in enumerate(rows)]
    return per_expert_transform(rule.transform).shard(parts, rank, size)[:, 0]


def block_b(B: torch.Tensor, part_mask: torch.Tensor | None) -> torch.Tensor:
    """B [N, r] as the block matrix [N, P*r] whose row n holds B's row n in its part's r columns
    (``part_mask`` [N, P]: one-hot parts of the rows; None: one part, B itself)."""
    if part_mask is None:
        return B
    return (part_mask[:, :, None] * B[:, None, :]).reshape(B.shape[0], -1)


def merged_weight(weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, parts: torch.Tensor | None,
                  scaling: float) -> torch.Tensor:
    """``weight + scaling * B A`` in fp32, back in the weight's dtype: weight [N, K], A [P*r, K] (or
    [r, K]), B [N, r], ``parts`` [N] the fused part of each row (None: one part). A leading expert
    axis on all three merges expert by expert."""
    if weight.dim() == 3:
        return torch.stack([merged_weight(w, a, b, parts, scaling) for w, a, b in zip(weight, A, B)])
    mask = None if parts is None else torch.nn.functional.one_hot(parts, A.shape[0] // B.shape[1]).float()
    return (weight.float() + scaling * (block_b(B.float(), mask) @ A.float())).to(weight.dtype)


@dataclass(frozen=True)
class AdapterParameters:
    total: int  # every adapter of the model
    per_decoder_layer: float  # one rank's share of one language decoder layer's adapters (a hybrid's: the mean)
    vision_and_projector: float  # one rank's share of the vision tower's and projector's adapters


def _fill(pattern: str, rule: Optional[Rule] = None) -> str:
    """``pattern`` at its rule's first layer (a hybrid decoder's rows of one kind skip the others) and expert (its
    set's first: ``Rule.expert_offset``)."""
    layer = 0 if rule is None or rule.layers is None else rule.layers[0]
    return pattern.replace("{i}", str(layer)).replace("{e}", str(0 if rule is None else rule.expert_offset))


def _part_shapes(rule: Rule, hf_shapes: dict) -> list[tuple[int, int]]:
    """[out, in] of each HF linear one of our weights holds (one expert's, for experts)."""
    if isinstance(rule.transform, FusedExperts):
        rows, columns = rule.transform.expert_shape
        return [(rows // rule.transform.parts, columns)] * rule.transform.parts
    return [tuple(hf_shapes[_fill(pattern, rule)][:2]) for pattern in rule.hf]


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
            experts = model_cfg.language.moe.num_experts
            whole, share = whole * experts, share * experts / expert_parallel
        if tower == "language":
            layers = language_layers if rule.layers is None else len(rule.layers)  # a hybrid's kind of layer
            total += whole * layers
            per_layer += share * layers / language_layers
        else:
            blocks = (rule.count or model_cfg.vision.depth) if "{i}" in rule.megatron else 1
            total += whole * blocks
            encoder += share * blocks
    return AdapterParameters(total=total, per_decoder_layer=per_layer, vision_and_projector=encoder)


# ---------------------------------------------------------------------------------------------
# The adapters' weight map: PEFT's tensors <-> ours, derived from the family's weight map
# ---------------------------------------------------------------------------------------------


def peft_name(hf_weight_name: str, matrix: str) -> str:
    """PEFT's tensor name (Hub style, no ``base_model.model.`` prefix) of the ``matrix`` ("A" or
    "B") of the adapter on the HF linear whose weight is ``hf_weight_name``."""
    return f"{hf_weight_name[: -len(_WEIGHT)]}.lora_{matrix}{_WEIGHT}"


@dataclass(frozen=True)
class StackedParts(Transform):
    """The A of a fused column-parallel linear: the parts' A matrices [r, K] stacked, [P*r, K],
    whole on every TP rank."""

    parts: int

    def shard(self, hf, rank, size):
        return torch.cat(list(hf))

    def unshard(self, shards):
        return list(shards[0].chunk(self.parts))


def adapter_rules(rule: Rule) -> list[Rule]:
    """The two rows of the adapters' map for one linear's weight rule: A and B, each with the HF
    names PEFT gives them and the transform that fuses and splits them as this linear needs."""
    base = rule.megatron[: -len(_WEIGHT)]
    hf_a = tuple(peft_name(name, "A") for name in rule.hf)
    hf_b = tuple(peft_name(name, "B") for name in rule.hf)
    if is_column_rule(rule):
        a, b = StackedParts(len(rule.hf)), rule.transform
    else:
        a, b = rule.transform, Replicated()
    return [Rule(hf_a, base + LORA_A, a, rule.group, count=rule.count, layers=rule.layers),
            Rule(hf_b, base + LORA_B, b, rule.group, count=rule.count, layers=rule.layers)]


def lora_rules(model_cfg: ModelConfig) -> list[Rule]:
    """The adapters' weight map of ``model_cfg``'s family: for every block linear (one with a
    ``layer_kinds`` kind) PEFT's lora_A / lora_B names <-> our ``lora.A`` / ``lora.B``. Give it to
    ``hf_weights.hf_to_megatron`` / ``megatron_to_hf`` (``rules=``) to read or write PEFT's tensors.
    Experts fused into one HF tensor per layer have no PEFT modules and are left out."""
    rules = []
    for rule in get_family(model_cfg.family).hf_rules(model_cfg):
        if rule.megatron.endswith(_WEIGHT) and _kind_of_rule(rule) and not rule.fuses_experts:
            rules += adapter_rules(rule)
    return rules


def _kind_of_rule(rule: Rule) -> Optional[str]:
    filled = rule.megatron.replace("{i}", "0").replace("{e}", "0")
    return layer_kind(filled[: -len(_WEIGHT)])
