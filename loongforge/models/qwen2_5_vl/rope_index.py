"""M-RoPE position ids of one Qwen2.5-VL sample (temporal, height, width): ``vlm.mrope_index``'s rule
with a video as one run whose temporal ids step by ``tokens_per_second`` x seconds per temporal patch.

This is transformers 5.x (``Qwen2_5_VLModel.get_rope_index``); the original Qwen release resumed text
after a *video* at ``1 + max`` of all its ids, temporal included, which differs when the temporal ids
outrun the spatial ones.

Worked example: ``[t t <vs> I I I I I I <ve> t]`` with one image of grid (1, 4, 6) (merged
2x3, so 6 pad tokens ``I``), merge 2::

    token     t  t  vs  I  I  I  I  I  I  ve  t
    temporal  0  1  2   3  3  3  3  3  3  6   7
    height    0  1  2   3  3  3  4  4  4  6   7
    width     0  1  2   3  4  5  3  4  5  6   7

``<ve>`` is text, so it starts at 3 + max(4, 6) / 2 = 6. A video of grid (3, 2, 2) (one
merged token per frame pair) at 2 tokens/s and 1 s per temporal patch gets temporal ids
s, s+2, s+4.
"""

from __future__ import annotations

import functools

from loongforge.models.vlm import mrope_index

get_rope_index = functools.partial(mrope_index.get_rope_index, frames_as_images=False)
position_ids_for = functools.partial(mrope_index.position_ids_for, frames_as_images=False)
