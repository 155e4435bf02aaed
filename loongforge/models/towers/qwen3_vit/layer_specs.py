"""The Qwen3-VL vision block: the shared pre-norm block with LayerNorm (weight and bias) pre-norms,
bidirectional within each frame.

Transformer Engine's norm-linear reads the norm kind from the config (``normalization="LayerNorm"``,
see ``configs.vision_config``); the local backends get ``layer_backend.LayerNormColumnParallelLinear``,
which names its weights as TE does (``layer_norm_weight``, ``layer_norm_bias``).
"""

from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import BlockModules, layer_norm_modules


def vision_layer_spec(modules: BlockModules) -> ModuleSpec:
    # no_mask: bidirectional inside each frame; TE maps it to "padding" for packed input.
    return transformer_layer_spec(layer_norm_modules(modules), AttnMaskType.no_mask)
