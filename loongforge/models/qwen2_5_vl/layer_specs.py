"""megatron-core layer specs for Qwen2.5-VL: the same pre-norm block for both towers.

Both towers use megatron-core's local (plain torch) linear layers, so parameter names and the
checkpoint map do not depend on the attention backend; only ``core_attention`` changes (see
``loongforge.models.attention``). The language model is causal, the vision tower is not.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


class RMSNorm(torch.nn.Module):
    """RMSNorm as Qwen computes it: normalise in fp32, cast back, then scale.

    Built with megatron's norm signature ``(config, hidden_size, eps)``. Under sequence parallelism
    each TP rank sees different tokens, so the weight is marked ``sequence_parallel`` and megatron's
    ``finalize_model_grads`` all-reduces its gradient over TP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def mlp_submodules() -> MLPSubmodules:
    """Column-parallel up-projection, row-parallel down-projection."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def transformer_layer_spec(core_attention: type, attn_mask_type: AttnMaskType) -> ModuleSpec:
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": attn_mask_type},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=ModuleSpec(module=MLP, submodules=mlp_submodules()),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def language_layer_spec(core_attention: type) -> ModuleSpec:
    return transformer_layer_spec(core_attention, AttnMaskType.causal)


def vision_layer_spec(core_attention: type) -> ModuleSpec:
    # no_mask: bidirectional inside each window / image; TE maps it to "padding" for packed input.
    return transformer_layer_spec(core_attention, AttnMaskType.no_mask)


def language_block_spec(
    config: TransformerConfig, core_attention: type, *, pp_rank: int, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder layers plus the final norm (a ``TransformerBlock`` spec).

    Given as block submodules rather than a layer spec so that the final norm is our ``RMSNorm``
    and not megatron's global default norm class.
    """
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[language_layer_spec(core_attention)] * num_layers, layer_norm=RMSNorm
    )
