"""LLaVA-OneVision's anyres packing: an image's per-square features (the base image's, then each
crop's, from the encoder) become the features its placeholder tokens take, in the processor's count
(``anyres.anyres_tokens``): the base image's patches; then the crops' patches laid back out as one
canvas, the padding the processor added cut away (unpadded to the image's proportions), shrunk
bilinearly when it exceeds ``max_crops`` crops' worth, and a learned newline vector after each row.
An image sharing its sample with others (one square) is its patches and one newline. Equal to
transformers' ``LlavaOnevisionModel.pack_image_features`` (``tests/models/test_anyres_packing.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loongforge.models.llava_onevision.anyres import AnyresSettings, best_canvas


def _unpadded(canvas: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[h, H, W] -> the rows or columns that hold the image (the processor centred it with padding)."""
    _, rows, columns = canvas.shape
    if width / height > columns / rows:
        padding = (rows - int(round(height * (columns / width), 7))) // 2
        return canvas[:, padding:rows - padding, :]
    padding = (columns - int(round(width * (rows / height), 7))) // 2
    return canvas[:, :, padding:columns - padding]


def pack_anyres(features: torch.Tensor, image_size: tuple[int, int], newline: torch.Tensor,
                settings: AnyresSettings, patch_size: int) -> torch.Tensor:
    """features [squares, side^2, h] of one image (the base image first), its (height, width) in
    pixels and newline [h] -> [tokens, h] for its placeholders."""
    base = features[0]  # [side^2, h]
    if features.shape[0] == 1:
        return torch.cat([base, newline[None].to(base)])
    side = settings.size // patch_size
    canvas_height, canvas_width = best_canvas(*image_size, settings)
    crop_rows, crop_columns = canvas_height // settings.size, canvas_width // settings.size
    # [crop row, crop column, patch row, patch column, h] -> [h, canvas rows, canvas columns]
    grid = features[1:].view(crop_rows, crop_columns, side, side, -1).permute(4, 0, 2, 1, 3)
    canvas = _unpadded(grid.reshape(grid.shape[0], crop_rows * side, crop_columns * side), *image_size)
    rows, columns = canvas.shape[1:]
    ratio = math.sqrt(rows * columns / (settings.max_crops * side**2))
    if ratio > 1.1:
        canvas = F.interpolate(canvas[None], [int(rows // ratio), int(columns // ratio)], mode="bilinear")[0]
    newlines = newline[:, None, None].expand(*canvas.shape[:-1], 1).to(canvas)
    packed = torch.cat([canvas, newlines], dim=-1).flatten(1, 2).transpose(0, 1)  # [rows * (columns + 1), h]
    return torch.cat([base, packed])
