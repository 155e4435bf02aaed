"""Interleaved M-RoPE: Qwen3-VL's rotary angles from 3-D (temporal, height, width) position ids.

Qwen2.5-VL (megatron's ``MultimodalRotaryEmbedding``) gives each axis one contiguous block of the
head's rotary frequencies: ``[t t t ... h h h ... w w w ...]``. Qwen3-VL interleaves them, so every
axis spans low and high frequencies: frequency ``j`` (of ``head_dim / 2``) follows

- height when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``,
- width when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``,
- time otherwise (``mrope_section[0]`` of them when the sections sum to ``head_dim / 2``).

E.g. head_dim 32, sections [6, 5, 5]: ``t h w t h w t h w t h w t h w t``.

The output has megatron's (and transformers') non-interleaved rotate-half layout,
``[angles, angles]`` over the head, shape [s, b, 1, head_dim], which megatron's
``apply_rotary_pos_emb`` takes as it takes ``MultimodalRotaryEmbedding``'s (thd too: with as many
rows as packed tokens it reads each token's own angles).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def interleaved_axes(mrope_section: Sequence[int], num_freqs: int) -> torch.Tensor:
    """LongTensor[num_freqs]: which position axis (0 t, 1 h, 2 w) drives each rotary frequency."""
    if sum(mrope_section) != num_freqs:
        raise ValueError(f"mrope_section={list(mrope_section)} must sum to head_dim/2={num_freqs}")
    axes = torch.zeros(num_freqs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * mrope_section[axis] : 3] = axis
    return axes


class InterleavedMRoPE(torch.nn.Module):
    """Drop-in for megatron's ``MultimodalRotaryEmbedding`` (same call) with the interleaved layout."""

    def __init__(self, head_dim: int, mrope_section: Sequence[int], rotary_base: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / rotary_base**exponents, persistent=False)
        self.register_buffer("axes", interleaved_axes(mrope_section, head_dim // 2), persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: Optional[list[int]] = None,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        """position_ids [3, b, s] -> angles [s, b, 1, head_dim]. ``mrope_section`` is fixed at
        construction (megatron passes its config's; they are the same numbers). Under context
        parallelism the angles are the whole packed row's, whatever ``cp_group``: megatron's thd
        rotary code picks this CP rank's chunks of every sample from them."""
        angles = position_ids[..., None].float() * self.inv_freq  # [3, b, s, hd/2]
        index = self.axes.view(1, 1, 1, -1).expand(1, *angles.shape[1:])
        chosen = angles.gather(0, index)[0]  # [b, s, hd/2]
        return torch.cat([chosen, chosen], dim=-1).transpose(0, 1)[:, :, None, :].contiguous()
