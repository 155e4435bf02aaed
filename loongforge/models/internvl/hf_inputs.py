"""transformers' InternVL forward inputs from loongforge's batch (``ModelFamily.hf_model_inputs``): its
processor returns whole tiles ``pixel_values [n, C, S, S]``, where the batch holds their patch rows
(``models.vlm.pixels.patch_rows``)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.vlm.vision_common import square_pixels, square_side


def model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    rows = inputs["media"].rows("image")  # [n * side^2, C*p*p]
    if rows is None:
        return {"input_ids": inputs["input_ids"]}
    vis = model_cfg.vision
    tiles = square_pixels(rows, vis.patch_size, vis.in_channels, square_side(vis))  # [n, C, S, S]
    return {"input_ids": inputs["input_ids"], "pixel_values": tiles}
