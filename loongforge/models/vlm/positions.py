"""Rotary positions of one sample of a VLM with 1-D RoPE (InternVL, LLaVA-OneVision): every token,
image placeholders included, numbered as text, in the three rows every family's batch carries."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig


def sequential_positions(input_ids: torch.Tensor, image_grid_thw=None, video_grid_thw=None,
                         second_per_grid_ts=None) -> torch.Tensor:
    """[3, L]: three equal rows 0..L-1 (the decoder reads the first)."""
    return torch.arange(input_ids.shape[0]).expand(3, -1)


def sequential_positions_for(model_cfg: ModelConfig):
    return sequential_positions
