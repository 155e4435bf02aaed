"""InternViT's block: the shared pre-norm block with LayerNorm pre-norms, bidirectional within each
tile, and layer scale: the attention's and the MLP's outputs are each multiplied by a learned
per-channel vector (transformers' ``lambda_1`` / ``lambda_2``) before their residual add.

megatron's ``TransformerLayer`` adds a sublayer's (output, bias) to the residual in its
bias-dropout-add; each sublayer returns both already scaled (a forward hook), so the rest of the
layer is megatron's unchanged. The scale is replicated over the tower's TP group (a row-parallel output is
whole on every rank).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layer_backend import BlockModules, layer_norm_modules


def _scaled_output(module: torch.nn.Module, args, output: tuple) -> tuple:
    """Forward hook of a scaled sublayer: its (output, bias), each times its ``layer_scale``."""
    hidden, bias = output
    return hidden * module.layer_scale, None if bias is None else bias * module.layer_scale


class LayerScaledTransformerLayer(TransformerLayer):
    """megatron's layer whose attention and MLP each carry a ``layer_scale`` [hidden] that scales
    their output (a hook on each: megatron picks an MLP's process groups by its exact class, so the
    sublayers stay megatron's own)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        for sublayer in (self.self_attention, self.mlp):
            sublayer.layer_scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
            sublayer.register_forward_hook(_scaled_output)


def vision_layer_spec(modules: BlockModules) -> ModuleSpec:
    # no_mask: bidirectional inside each tile; TE maps it to "padding" for packed input.
    spec = transformer_layer_spec(layer_norm_modules(modules), AttnMaskType.no_mask)
    spec.module = LayerScaledTransformerLayer
    return spec
