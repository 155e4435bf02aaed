"""transformers' LLaVA-OneVision forward inputs from loongforge's batch (``ModelFamily.hf_model_inputs``):
its processor returns each image's squares whole, ``pixel_values [images, max squares, C, S, S]`` (zero
squares after an image's own) with ``image_sizes``, where the batch holds the squares' whole patches
(a valid convolution never reads the last ``S % p`` pixels of a side: zeros stand for them)."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig


def model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    rows = inputs.get("pixel_values")  # [squares * side^2, C*p*p]
    if rows is None:
        return {"input_ids": inputs["input_ids"]}
    vis = model_cfg.vision
    patch, size, channels = vis.patch_size, vis.image_size, vis.in_channels
    side = size // patch
    squares = rows.view(-1, side, side, channels, patch, patch).permute(0, 3, 1, 4, 2, 5)
    squares = squares.reshape(-1, channels, side * patch, side * patch)  # [n, C, side*p, side*p]
    counts = inputs["image_grid_thw"][:, 0].tolist()
    pixels = torch.zeros(len(counts), max(counts), channels, size, size, dtype=rows.dtype)
    for image, part in enumerate(squares.split(counts)):
        pixels[image, :part.shape[0], :, :side * patch, :side * patch] = part
    return {"input_ids": inputs["input_ids"], "pixel_values": pixels, "image_sizes": inputs["image_sizes"]}
