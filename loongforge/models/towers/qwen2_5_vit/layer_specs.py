"""The Qwen2.5-VL vision tower's layer: the decoder's pre-norm block, bidirectional."""

from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_backend import BlockModules


def vision_layer_spec(modules: BlockModules) -> ModuleSpec:
    # no_mask: bidirectional inside each window / image; TE maps it to "padding" for packed input.
    return transformer_layer_spec(modules, AttnMaskType.no_mask)
