"""transformers' LLaVA-OneVision forward inputs from loongforge's batch (``ModelFamily.hf_model_inputs``):
its processor returns each image's squares whole, ``pixel_values [images, max squares, C, S, S]`` (zero
squares after an image's own) with ``image_sizes``, where the batch (``models.media.MediaBatch``) holds the squares' whole patches
(a valid convolution never reads the last ``S % p`` pixels of a side: zeros stand for them)."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.vlm.vision_common import square_pixels, square_side


def model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    images = inputs["media"].images
    if images is None:
        return {"input_ids": inputs["input_ids"]}
    vis, rows = model_cfg.vision, images.rows  # [squares * side^2, C*p*p]
    whole = square_side(vis) * vis.patch_size  # pixels of a square's whole patches
    squares = square_pixels(rows, vis.patch_size, vis.in_channels, square_side(vis))  # [n, C, whole, whole]
    counts = images.grids[:, 0].tolist()
    pixels = torch.zeros(len(counts), max(counts), vis.in_channels, vis.image_size, vis.image_size, dtype=rows.dtype)
    for image, part in enumerate(squares.split(counts)):
        pixels[image, :part.shape[0], :, :whole, :whole] = part
    return {"input_ids": inputs["input_ids"], "pixel_values": pixels, "image_sizes": images.sizes}
