"""transformers' InternVL forward inputs from loongforge's batch (``ModelFamily.hf_model_inputs``): its
processor returns whole tiles ``pixel_values [n, C, S, S]``, where the batch holds their patch rows
(``models.pixels.patch_rows``)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    rows = inputs.get("pixel_values")  # [n * side^2, C*p*p]
    if rows is None:
        return {"input_ids": inputs["input_ids"]}
    patch, size = model_cfg.vision.patch_size, model_cfg.vision.image_size
    side, channels = size // patch, model_cfg.vision.in_channels
    tiles = rows.view(-1, side, side, channels, patch, patch)  # [n, row, column, C, py, px]
    return {"input_ids": inputs["input_ids"],
            "pixel_values": tiles.permute(0, 3, 1, 4, 2, 5).reshape(-1, channels, size, size)}  # [n, C, S, S]
