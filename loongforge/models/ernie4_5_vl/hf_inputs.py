"""transformers' ERNIE-4.5-VL forward inputs from loongforge's batch (``ModelFamily.hf_model_inputs``): the
patch rows and grids as they are, each token's modality for the 3-D positions (``mm_token_type_ids``: the
image placeholders) and for the experts (``moe_mm_token_type_ids``: the placeholders and their markers), as
its processor returns them."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig


def routing_token_ids(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The ids the decoder routes to its vision experts: the placeholders and the image markers."""
    tokens = model_cfg.tokens
    return (tokens.image_token_id, tokens.video_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id)


def model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    ids, media = inputs["input_ids"], inputs["media"]
    given = {}
    if media.images is not None:
        given.update(pixel_values=media.images.rows, image_grid_thw=media.images.grids)
    kinds = (ids == model_cfg.tokens.image_token_id).long()
    vision = torch.isin(ids, torch.tensor(routing_token_ids(model_cfg), device=ids.device)).long()
    return {"input_ids": ids, **given, "mm_token_type_ids": kinds, "moe_mm_token_type_ids": vision}
