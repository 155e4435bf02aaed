"""M-RoPE over interleaved channel pairs with height and width alternating (ERNIE-4.5-VL's 3-D rotary).

Each head's channels rotate in adjacent pairs (channels 2j and 2j+1 by frequency j, megatron's
``rotary_interleaved``), and frequency ``j`` (of ``head_dim / 2``, transformers' base frequencies) follows

- height when ``j < mrope_section[0] + mrope_section[1]`` and ``j`` is even,
- width when ``j`` is odd below that,
- time for the last ``mrope_section[2]`` frequencies.

E.g. head_dim 16, sections [3, 3, 2]: ``h w h w h w t t``. A text token's three positions are equal, so
it rotates as 1-D RoPE over interleaved pairs. The angles come out in megatron's interleaved layout,
each frequency's angle twice in a row, shape [s, b, 1, head_dim].
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def paired_axes(mrope_section: Sequence[int], num_freqs: int) -> torch.Tensor:
    """LongTensor[num_freqs]: which position axis (0 t, 1 h, 2 w) drives each rotary frequency."""
    height, width, time = mrope_section
    if height != width or sum(mrope_section) != num_freqs:
        raise ValueError(f"mrope_section={list(mrope_section)} must give height and width as many frequencies "
                         f"and sum to head_dim/2={num_freqs}")
    axes = torch.zeros(num_freqs, dtype=torch.long)
    axes[0 : height + width : 2] = 1
    axes[1 : height + width : 2] = 2
    return axes


class PairedMRoPE(torch.nn.Module):
    """Drop-in for megatron's ``MultimodalRotaryEmbedding`` (same call) with the layout above; the decoder
    must apply it with ``rotary_interleaved``."""

    def __init__(self, head_dim: int, mrope_section: Sequence[int], rotary_base: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / rotary_base**exponents, persistent=False)
        self.register_buffer("axes", paired_axes(mrope_section, head_dim // 2), persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: Optional[list[int]] = None,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        """position_ids [3, b, s] -> angles [s, b, 1, head_dim]; ``mrope_section`` is fixed at construction,
        and the angles are the whole row's whatever ``cp_group`` (as ``InterleavedMRoPE``'s)."""
        angles = position_ids[..., None].float() * self.inv_freq  # [3, b, s, hd/2]
        index = self.axes.view(1, 1, 1, -1).expand(1, *angles.shape[1:])
        chosen = angles.gather(0, index)[0]  # [b, s, hd/2]
        return chosen.repeat_interleave(2, dim=-1).transpose(0, 1)[:, :, None, :].contiguous()
