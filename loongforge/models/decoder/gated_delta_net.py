"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5's ``linear_attention`` layers, as a
megatron-core module in a ``TransformerLayer``'s self-attention slot.

Per token: one projection gives q, k, v (per key head ``d_k``, per value head ``d_v``), an output gate z
(per value head), and two scalars per value head, b and a; a depthwise causal convolution (K taps, then
SiLU) runs over q, k, v; the gated delta rule (``models.decoder.linear_attention``) reads them with the decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and the write strength ``beta = sigmoid(b)``; each value head's
output is RMS-normalised, multiplied by SiLU(z), and projected back to the hidden size.

Layout: the projection's rows (and the convolution's channels) are grouped by key head, each group holding
its key head's q and k and the ``num_value_heads / num_key_heads`` value heads it serves (their v, z, b, a):
``[q_0 k_0 v_0 z_0 b_0 a_0 | q_1 k_1 ...]``. TP splits whole groups (the projection column-parallel, the
convolution, ``A_log`` and ``dt_bias`` along their channels, ``out_proj`` row-parallel), so a rank's groups
are a contiguous block and a checkpoint reshards to any TP size like any other column-parallel weight.
``hf_rules.GroupedRows`` maps transformers' separate ``in_proj_qkv / in_proj_z / in_proj_b / in_proj_a``
to it. Under sequence parallelism the projection gathers the sequence first (the recurrence needs a
sample's whole run of tokens) and ``out_proj`` scatters it back.

Packed rows: the convolution and the recurrent state restart at every sample of ``cu_seqlens``, so no
token sees another sample. Under context parallelism a rank holds two chunks of each sample and the state is
carried across the ranks' chunks (``linear_attention_cp``). The rule runs on the kernel the layer backend chose (``BlockModules.
linear_attention``: fla's Triton kernel on GPU where installed, the plain-torch chunked rule elsewhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import divide

from loongforge.models.layers.initialization import draws_on_cpu, seeded_below
from loongforge.models.decoder.linear_attention import causal_conv1d
from loongforge.models.decoder.linear_attention_cp import context_parallel_rule, windowed_causal_conv1d

# Per-channel TP-sharded tensors of the layer itself (axis 0), for its sharded state dict.
_SHARDED_OWN = {"A_log": 0, "dt_bias": 0}


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: type  # column-parallel, with the layer's pre-norm fused in (``layer_norm_weight``)
    out_proj: type  # row-parallel
    # (q [T, H_k, d_k], k, v [T, H_v, d_v], g [T, H_v], beta, cu_seqlens) -> [T, H_v, d_v]
    rule: Callable[..., torch.Tensor]


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over each value head's channels, then times SiLU(gate): the statistics in fp32, the scale in
    the input's dtype (transformers' ``Qwen3_5RMSNormGated``). The weight is shared by every head, so under
    TP each rank's gradient covers its own heads only: the forward reads it through an identity whose
    backward sums the gradient over TP."""

    def __init__(self, channels: int, eps: float, config: TransformerConfig, tp_group):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = torch.nn.Parameter(torch.ones(channels, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        weight = self.weight
        if self.tp_group.size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet in megatron's self-attention slot: [s(/tp), b, h] -> ([s(/tp), b, h], bias)."""

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int,
                 pg_collection: Optional[ProcessGroupCollection] = None, cp_comm_type: Optional[str] = None,
                 **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        groups = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = groups.tp
        # CP > 1: the rank's chunks of each sample, the state carried across ranks (``linear_attention_cp``)
        self.cp_group = groups.cp if config.context_parallel_size > 1 else None
        tp = self.tp_group.size()
        self.key_heads = divide(config.linear_num_key_heads, tp)  # this rank's key heads (groups)
        self.value_per_key = divide(config.linear_num_value_heads, config.linear_num_key_heads)
        self.d_k, self.d_v = config.linear_key_head_dim, config.linear_value_head_dim
        r = self.value_per_key
        # One group's rows of the projection and channels of the convolution.
        self.group_rows = (self.d_k, self.d_k, r * self.d_v, r * self.d_v, r, r)  # q k v z b a
        conv_per_group = sum(self.group_rows[:3])
        self.rule = submodules.rule

        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, config.linear_num_key_heads * sum(self.group_rows),
            config=config, init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        with seeded_below("self_attention.conv1d"):
            self.conv1d = torch.nn.Conv1d(self.key_heads * conv_per_group, self.key_heads * conv_per_group,
                                          kernel_size=config.linear_conv_kernel_dim,
                                          groups=self.key_heads * conv_per_group, bias=False,
                                          dtype=config.params_dtype)
        value_heads = self.key_heads * r
        self.A_log = torch.nn.Parameter(torch.empty(value_heads, dtype=config.params_dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(value_heads, dtype=config.params_dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            # Split over TP: the grad norm counts each rank's part, the optimizer shards it as such.
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = GatedRMSNorm(self.d_v, config.layernorm_epsilon, config, self.tp_group)
        self.out_proj = build_module(
            submodules.out_proj, config.linear_num_value_heads * self.d_v, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=self.tp_group)
        self._initialize(conv_per_group)

    def _initialize(self, conv_per_group: int) -> None:
        """The convolution and the decays drawn whole and sliced to this rank, so every TP size starts from
        one model (the linears are megatron's, drawn whole on CPU too): the convolution as ``nn.Conv1d``
        draws it (uniform, bound 1/sqrt(K)), A = exp(A_log) uniform in [1, 16], dt_bias ones."""
        if not draws_on_cpu(self.config):
            with torch.no_grad():
                self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
            return
        config, tp, rank = self.config, self.tp_group.size(), self.tp_group.rank()
        channels, taps = config.linear_num_key_heads * conv_per_group, config.linear_conv_kernel_dim
        with seeded_below("self_attention.conv1d"):
            conv = torch.empty(channels, 1, taps).uniform_(-1 / math.sqrt(taps), 1 / math.sqrt(taps))
        with seeded_below("self_attention.A_log"):
            a_log = torch.empty(config.linear_num_value_heads).uniform_(1, 16).log()
        with torch.no_grad():
            self.conv1d.weight.copy_(conv.chunk(tp)[rank].to(self.conv1d.weight.dtype))
            self.A_log.copy_(a_log.chunk(tp)[rank].to(self.A_log.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused):
        projected, _ = self.in_proj(hidden_states)  # [s, b, groups * rows]
        seq_len, batch = projected.shape[:2]
        pieces = projected.reshape(seq_len, batch, self.key_heads, -1).split(self.group_rows, dim=-1)
        q_k_v, z, b, a = torch.cat(pieces[:3], dim=-1), pieces[3], pieces[4], pieces[5]
        cu_seqlens = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
        outputs = []
        for row in range(batch):  # packed rows have b = 1; each unpacked row is one sample
            outputs.append(self._mix(q_k_v[:, row], z[:, row], b[:, row], a[:, row], cu_seqlens))
        mixed = torch.stack(outputs, dim=1)  # [s, b, value heads * d_v]
        return self.out_proj(mixed)

    def _mix(self, q_k_v: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """One row: q_k_v [T, G, 2 d_k + r d_v], z [T, G, r d_v], b, a [T, G, r] -> [T, G r d_v]."""
        length, groups = q_k_v.shape[:2]
        if self.cp_group is None:
            convolved = causal_conv1d(q_k_v.reshape(length, -1), self.conv1d.weight[:, 0], None, cu_seqlens)
        else:
            convolved = windowed_causal_conv1d(q_k_v.reshape(length, -1), self.conv1d.weight[:, 0], cu_seqlens,
                                               self.cp_group)
        q, k, v = convolved.reshape(length, groups, -1).split(self.group_rows[:3], dim=-1)
        v = v.reshape(length, groups * self.value_per_key, self.d_v)  # [T, H_v, d_v]
        g = -self.A_log.float().exp() * F.softplus(a.reshape(length, -1).float() + self.dt_bias)  # [T, H_v]
        beta = b.reshape(length, -1).sigmoid()
        if self.cp_group is None:
            out = self.rule(q, k, v, g, beta, cu_seqlens)  # [T, H_v, d_v]
        else:
            out = context_parallel_rule(self.rule, q, k, v, g, beta, cu_seqlens, self.cp_group)
        gated = self.out_norm(out, z.reshape(length, -1, self.d_v))
        return gated.reshape(length, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """TP-sharded along axis 0: the projection (its module's own rule), the convolution, ``A_log`` and
        ``dt_bias``; ``out_norm`` replicated; ``out_proj`` its module's rule."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(own, prefix, _SHARDED_OWN, sharded_offsets,
                                                      tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            if name == "conv1d":
                sharded.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}{name}.", {"weight": 0}, sharded_offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
            else:
                sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        return sharded
