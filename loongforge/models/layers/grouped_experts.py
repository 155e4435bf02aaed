"""Grouped-GEMM experts: every local expert's projection in one grouped matrix multiply.

megatron-core's MoE layer sorts the tokens into expert order once (its token dispatcher's ``permute``: one
``masked_select`` of token indices over the expert-major routing map, a counting sort with no loop), hands
the experts the sorted rows with each expert's row count and each row's routing weight, and adds the rows back
to their tokens after (``unpermute``). ``SequentialMLP`` then runs one MLP per expert in a Python loop: on a
GPU 3 GEMMs and a few elementwise kernels per expert, 128 experts a layer in Qwen3-30B-A3B. ``GroupedExperts``
computes the same function with one grouped GEMM per projection:

    h = x W1_e^T           for the rows x of expert e   (one grouped GEMM over all experts)
    a = act(gate(h)) * up(h) * p                        (SwiGLU; plain act(h) * p without a gated unit)
    y = a W2_e^T                                        (one grouped GEMM)

where p is each row's routing weight, applied before the second projection as megatron's expert MLP does,
so the dispatcher's unpermute is a plain sum. On CUDA the grouped GEMM is ``torch._grouped_mm`` (its kernels
take bf16); elsewhere the same function runs as a loop over the experts, the plain matmuls megatron's linears
make, so CPU results are the reference math (``grouped_linear``).

Checkpoints are ``SequentialMLP``'s: the module IS a ``SeededSequentialMLP`` (the experts' linears and
weights, their names, ``sharded_state_dict``, the seeded initialisation, the local experts under EP), with only
``forward`` replaced; on CUDA the weights are stacked per forward ([E, N, K], a copy of the expert weights,
timed by ``loongforge bench moe``), and their gradients flow back to each expert's own weight. Conversion, resume and
the HF mapping see no difference.

A linear carrying a per-linear patch that the grouped GEMM would bypass (a LoRA adapter, FP8 GEMMs:
``models.layers.lora`` and ``models.layers.fp8`` install them on each expert linear) makes the layer run
``SequentialMLP``'s forward, whose linears run the patches. Expert linears hold no biases (no family has them:
the decoder's config sets ``add_bias_linear=False``); a config with them is refused when the layer is built. On
CUDA the kernel reads bf16 rows aligned to 16 bytes: widths a multiple of 8 (every family's are); it raises its
own error otherwise.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from loongforge.models.layers.initialization import SeededSequentialMLP


def grouped_linear(rows: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its weight transposed: ``rows`` [T, K] sorted by expert, ``weights`` E tensors
    [N, K], ``tokens_per_expert`` [E] (summing to T) -> [T, N]. On CUDA one ``torch._grouped_mm`` over the
    weights stacked to [E, N, K] (the kernel takes one tensor; the copy is what ``bench moe`` reports as
    stacking); elsewhere a loop of the plain ``x @ w.t()`` megatron's linears compute (the reference math, no
    copy)."""
    if rows.is_cuda:
        # offs[e]: the end row of expert e; int32, on the rows' device (the dispatcher counts on the host).
        offsets = torch.cumsum(tokens_per_expert.to(device=rows.device), 0).to(torch.int32)  # [E]
        stacked = torch.stack(list(weights))  # [E, N, K]
        return torch._grouped_mm(rows, stacked.transpose(1, 2), offs=offsets)  # [T, N]
    chunks = rows.split(tokens_per_expert.tolist())
    return torch.cat([chunk @ weight.t() for chunk, weight in zip(chunks, weights)])  # [T, N]


def swiglu(intermediate: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the [gate, up] halves (``training.compile``'s ``swiglu`` part compiles it)."""
    gate, up = torch.chunk(intermediate, 2, dim=-1)  # [T, F] each
    return F.silu(gate) * up  # [T, F]


class GroupedExperts(SeededSequentialMLP):
    """``SeededSequentialMLP`` (its parameters, checkpoint layout and initialisation) whose forward runs every
    local expert at once (``grouped_linear`` per projection)."""

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None):
        if config.add_bias_linear:
            raise ValueError("GroupedExperts adds no expert biases and this config has them (add_bias_linear); "
                             "use model.language.moe.experts=sequential")
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """``permuted_local_hidden_states`` [T, H] in expert order, ``tokens_per_expert`` [E_local],
        ``permuted_probs`` [T] -> ([T, H], None), as ``SequentialMLP.forward``."""
        if self._linears_patched():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # top-1 routing: the weight scales the input instead
            hidden, probs = (probs.unsqueeze(-1) * hidden).to(hidden.dtype), torch.ones_like(probs)
        rows = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]  # E x [N1, H]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]  # E x [H, F]
        intermediate = grouped_linear(rows, fc1, tokens_per_expert)  # [T, N1]
        intermediate = self._activation(intermediate)  # [T, F]
        scaled = (intermediate * probs.reshape(-1, 1)).to(intermediate.dtype)  # [T, F]
        output = grouped_linear(scaled, fc2, tokens_per_expert)  # [T, H]
        return output.reshape(hidden.shape), None

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """megatron's expert MLP activation (its unfused path): the gated unit act(gate) * (up + offset), the
        two halves clamped where the config clamps them; else act(h)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(intermediate)
        if config.activation_func is F.silu and config.activation_func_clamp_value is None \
                and config.glu_linear_offset == 0.0:
            return swiglu(intermediate)
        gate, up = torch.chunk(intermediate, 2, dim=-1)  # [T, F] each
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (up + config.glu_linear_offset)

    def _linears_patched(self) -> bool:
        """Whether an expert linear carries a LoRA adapter or FP8 GEMMs (patches of the linear itself)."""
        return any(hasattr(linear, "lora") or getattr(linear, "fp8", False)
                   for expert in self.local_experts for linear in (expert.linear_fc1, expert.linear_fc2))
