"""The Qwen3-VL vision block: the shared pre-norm block with LayerNorm (weight and bias) pre-norms,
bidirectional within each frame.

Transformer Engine's norm-linear reads the norm kind from the config (``normalization="LayerNorm"``,
see ``configs.vision_config``); the local backends get ``LayerNormColumnParallelLinear``, which names
its weights as TE does (``layer_norm_weight``, ``layer_norm_bias``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layer_backend import BlockModules


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm (weight and bias), then a column-parallel linear; the local twin of TE's
    ``TELayerNormColumnParallelLinear`` with ``normalization="LayerNorm"``.

    The norm runs on the whole input before the linear's TP copy, whose backward all-reduces the
    input gradient, so the norm's gradients are whole and equal on every TP rank.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm_eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.layer_norm_weight.sequence_parallel = True
            self.layer_norm_bias.sequence_parallel = True

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        normed = F.layer_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.layer_norm_bias,
                              self.norm_eps)
        return super().forward(normed, *args, **kwargs)


def vision_modules(modules: BlockModules) -> BlockModules:
    """The run's block modules with a LayerNorm pre-norm (TE's norm-linear already follows the config)."""
    if modules.backend == "te":
        return modules
    return dataclasses.replace(modules, norm_column_linear=LayerNormColumnParallelLinear)


def vision_layer_spec(modules: BlockModules) -> ModuleSpec:
    # no_mask: bidirectional inside each frame; TE maps it to "padding" for packed input.
    return transformer_layer_spec(vision_modules(modules), AttnMaskType.no_mask)
