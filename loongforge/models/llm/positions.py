"""Rotary positions of one text-only sample: 0..L-1, in the three rows every family's batch carries."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig


def text_positions(input_ids: torch.Tensor, image_grid_thw=None, video_grid_thw=None,
                   second_per_grid_ts=None) -> torch.Tensor:
    """[3, L]: three equal rows 0..L-1 (M-RoPE with equal rows is plain RoPE)."""
    if image_grid_thw is not None or video_grid_thw is not None:
        raise ValueError("a text-only model has no image or video positions")
    return torch.arange(input_ids.shape[0]).expand(3, -1)


def position_ids_for(model_cfg: ModelConfig):
    return text_positions
