"""Where a transformer layer's norm weights live in megatron state dicts: one naming, one legacy.

Transformer Engine fuses each pre-norm into the linear after it (``TELayerNormColumnParallelLinear``),
so its layers hold the norm weights as ``self_attention.linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight``. loongforge's local layers are built the same way (see
``layer_specs.RMSNormColumnParallelLinear``), so every backend writes these *fused* names and a
checkpoint moves between a GPU run with TE and a CPU run without it unchanged.

megatron-core's plain local spec, and loongforge checkpoints written before the fused layout, keep
the norms as modules of their own: ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``
(*separate* names). Readers accept both; ``fused_name`` is the one translation.
"""

from __future__ import annotations

from typing import Iterable

# Separate-norm key suffix -> the fused-norm suffix of the same tensor.
SEPARATE_TO_FUSED = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
FUSED_TO_SEPARATE = {fused: separate for separate, fused in SEPARATE_TO_FUSED.items()}


def _rename(key: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if key == old or key.endswith("." + old):
            return key[: len(key) - len(old)] + new
    return key


def fused_name(key: str) -> str:
    """``key`` with a separate-norm suffix replaced by its fused name; other keys unchanged."""
    return _rename(key, SEPARATE_TO_FUSED)


def separate_name(key: str) -> str:
    """``key`` with a fused-norm suffix replaced by its separate name; other keys unchanged."""
    return _rename(key, FUSED_TO_SEPARATE)


def has_separate_norms(keys: Iterable[str]) -> bool:
    """Whether a state dict (or checkpoint) names its layer norms the separate way."""
    return any(fused_name(key) != key for key in keys)


# A LoRA adapter's matrices (``models.layers.lora``): children of the linear they adapt, ``<linear>.lora.A``.
LORA_A, LORA_B = ".lora.A", ".lora.B"


# Set by apply_lora on the model of every rank, also on a pipeline stage that got no adapter (LoRA on
# the projector alone): every rank's checkpoint share then holds the adapters alone, none the base.
LORA_ADAPTED = "lora_adapted"


def is_lora_model(model) -> bool:
    return bool(getattr(model, LORA_ADAPTED, False))


def is_adapter_key(key: str) -> bool:
    """Whether a parameter or state-dict key is a LoRA adapter's (not in the base model's HF map)."""
    return key.endswith((LORA_A, LORA_B))
