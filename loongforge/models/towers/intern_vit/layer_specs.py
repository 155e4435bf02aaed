"""InternViT's block: the shared pre-norm block with LayerNorm (InternViT-300M) or RMSNorm
(InternViT-6B) pre-norms, bidirectional within each tile, and layer scale: the attention's and the
MLP's outputs are each multiplied by a learned per-channel vector (transformers' ``lambda_1`` /
``lambda_2``) before their residual add. InternViT-6B also has q, k without bias and q/k norms.

The q/k norm of InternViT is an RMSNorm over the whole width of q (and of k), all heads at once, not
per head as megatron's ``q_layernorm`` slot (Qwen3's) assumes; with heads split over TP, each rank
holds part of that width, so the mean square is summed over the TP group (an all-reduce whose
backward all-reduces too: every rank's output depends on every rank's heads).

megatron's ``TransformerLayer`` adds a sublayer's (output, bias) to the residual in its
bias-dropout-add; each sublayer returns both already scaled (a forward hook), so the rest of the
layer is megatron's unchanged. The scale is replicated over the tower's TP group (a row-parallel output is
whole on every rank).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from loongforge.models.decoder.layer_specs import transformer_layer_spec
from loongforge.models.layers.layer_qk_norm import LayerQKNorm
from loongforge.models.layers.layer_backend import BlockModules, layer_norm_modules


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

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """megatron's, with each ``layer_scale`` (replicated over the TP group): megatron's MLP lists its
        linear layers' tensors only, so the MLP's scale would be neither saved nor known to the optimizer's
        checkpoint."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        scales = {f"{name}.layer_scale": sublayer.layer_scale
                  for name, sublayer in (("self_attention", self.self_attention), ("mlp", self.mlp))
                  if f"{prefix}{name}.layer_scale" not in sharded}
        sharded.update(make_sharded_tensors_for_checkpoint(scales, prefix, {}, sharded_offsets, tp_group=self.tp_group,
                                                           dp_cp_group=metadata["dp_cp_group"]))
        return sharded


# transformers' q/k RMSNorm keeps its default eps whatever the config's layer_norm_eps.
QK_NORM_EPS = 1e-6


class WholeWidthRMSNorm(LayerQKNorm):
    """InternViT-6B's q (or k) RMSNorm over all heads [..., heads_local, head_dim], the statistics over the heads of
    the whole TP group, its weight this rank's heads' part (sharded on axis 0: ``layers.layer_qk_norm``), at
    transformers' eps. A ViT's keys have as many heads as its queries."""

    def __init__(self, hidden_size: int, config, eps: float, *, tp_group: torch.distributed.ProcessGroup):
        super().__init__(hidden_size, config, QK_NORM_EPS, heads="query", tp_group=tp_group)


def without_bias(linear: type) -> type:
    """``linear`` built without a bias whatever megatron asks (its qkv bias follows
    ``add_bias_linear``, which InternViT-6B's output projection and MLP need)."""

    class Unbiased(linear):
        def __init__(self, *args, bias: bool = False, **kwargs):
            super().__init__(*args, bias=False, **kwargs)

    Unbiased.__name__ = Unbiased.__qualname__ = f"Unbiased{linear.__name__}"
    return Unbiased


def vision_layer_spec(modules: BlockModules, *, norm: str = "layer", qkv_bias: bool = True,
                      qk_norm_tp_group: torch.distributed.ProcessGroup | None = None) -> ModuleSpec:
    """``norm``: "layer" or "rms" pre-norms; ``qkv_bias``: q, k, v biases; ``qk_norm_tp_group``: the
    vision TP group when the block has InternViT-6B's q/k norms (None: none)."""
    block_modules = layer_norm_modules(modules) if norm == "layer" else modules
    # no_mask: bidirectional inside each tile; TE maps it to "padding" for packed input.
    spec = transformer_layer_spec(block_modules, AttnMaskType.no_mask)
    spec.module = LayerScaledTransformerLayer
    attention = spec.submodules.self_attention.submodules
    if not qkv_bias:
        attention.linear_qkv = without_bias(attention.linear_qkv)
    if qk_norm_tp_group is not None:
        head_norm = ModuleSpec(module=WholeWidthRMSNorm, params={"tp_group": qk_norm_tp_group})
        attention.q_layernorm = attention.k_layernorm = head_norm
    return spec
