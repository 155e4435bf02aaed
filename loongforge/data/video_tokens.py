"""Qwen3-VL's video token layout: one block per temporal patch, its time written as text before it.

A family with ``ChatFormat.timestamped_video_frames`` renders each video as a single video pad;
after tokenizing, that pad becomes, for every temporal patch ``k`` of the video's grid (t, h, w)::

    <{seconds_k:.1f} seconds> <|vision_start|> <|video_pad|> x (h*w / merge**2) <|vision_end|>

``seconds_k`` is the mean time of the patch's first and last frame (``vision.frame_timestamps``).
This is Qwen3VLProcessor's text; the timestamp is tokenized alone with the run's tokenizer, which
gives the ids the processor gets whenever the character before the video is a newline, a special
token or nothing (as in every chat-formatted sample; text such as ``"clip: <video>"`` could merge
its space with ``<`` there). The inserted tokens are inputs only: never answer tokens.
"""

from __future__ import annotations

import numpy as np

from loongforge.config.schema import TokenIdsConfig
from loongforge.data.vision import VideoPlan, frame_timestamps


def timestamped_video_ids(plan: VideoPlan, tokenizer, tokens: TokenIdsConfig, temporal_patch_size: int,
                          merge_size: int) -> np.ndarray:
    """int64 token ids that replace one video's pad: a timestamped block per temporal patch."""
    _, grid_h, grid_w = plan.grid_thw
    frame = [tokens.vision_start_token_id, *[tokens.video_token_id] * (grid_h * grid_w // merge_size ** 2),
             tokens.vision_end_token_id]
    ids: list[int] = []
    for seconds in frame_timestamps(plan, temporal_patch_size):
        ids += tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"]
        ids += frame
    return np.asarray(ids, dtype=np.int64)
