"""The q/k norms over all heads at once (``model.language.qk_norm_type: per_layer``, MiniMax-M2): one RMSNorm over
the whole query projection [heads x head_dim] and one over the whole key projection [groups x head_dim], a weight
per channel, where Qwen3's norm (megatron's ``q_layernorm`` slot) spans one head and shares its weight.

Under TP each rank holds ``heads / TP`` query heads and ``groups / TP`` key heads (validate asks TP to divide the
groups), so it holds that part of each weight (sharded on axis 0, as transformers' ``q_norm.weight`` is split) and
the mean square is summed over the TP group: an all-reduce whose backward all-reduces too, as every rank's output
depends on every rank's channels. The weight is no TP duplicate, so megatron must not sum its gradient over TP
(its ``qk_layernorm`` setting is off for these norms: ``configs.language_config``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient too (every rank's output reads the sum)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = local.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LayerQKNorm(torch.nn.Module):
    """RMSNorm over all of this layer's query (``heads="query"``) or key (``"key"``) heads [..., local heads,
    head_dim]: the statistics in fp32 over the whole TP group's channels, the scale in the input's dtype (as
    transformers' RMSNorm). Built by megatron's attention with its per-head slot's ``(hidden_size, config, eps)``."""

    def __init__(self, hidden_size: int, config, eps: float, *, heads: str, tp_group: torch.distributed.ProcessGroup):
        super().__init__()
        total = {"query": config.num_attention_heads, "key": config.num_query_groups}[heads]
        self.tp_group, self.eps = tp_group, eps
        self.full_width = total * config.kv_channels
        self.local_width = total // tp_group.size() * config.kv_channels
        self.weight = torch.nn.Parameter(torch.ones(self.local_width, dtype=config.params_dtype))
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        shape, dtype = heads.shape, heads.dtype
        x = heads.reshape(*shape[:-2], self.local_width).float()  # [..., local heads x head_dim]
        square_sum = x.pow(2).sum(-1, keepdim=True)
        if self.tp_group.size() > 1:
            square_sum = _SumOverGroup.apply(square_sum, self.tp_group)
        x = x * torch.rsqrt(square_sum / self.full_width + self.eps)
        return (self.weight * x.to(dtype)).view(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The weight sharded over TP on axis 0."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
