"""Interleaved M-RoPE position ids of one Qwen3-VL sample (temporal, height, width): ``vlm.mrope_index``'s
rule with every video frame a run of its own, positioned like a one-frame image (the processor writes
``<t seconds> <vision_start> frame <vision_end>`` per temporal patch): time reaches the model through
the timestamp text, not through temporal ids, so ``second_per_grid_ts`` is not used. This equals
transformers' ``Qwen3VLModel.get_rope_index``.

Worked example, merge 2: ``[t <vs> V V <ve> <ts> <vs> V V <ve> t]``, one video of grid (2, 2, 4)
(two frames, each merged 1x2, so 2 pad tokens ``V`` per frame; ``<ts>`` a timestamp token)::

    token     t  vs  V  V  ve  ts  vs  V  V  ve  t
    temporal  0  1   2  2  4   5   6   7  7  9   10
    height    0  1   2  2  4   5   6   7  7  9   10
    width     0  1   2  3  4   5   6   7  8  9   10

Each frame starts where the text before it ends and advances the text by max(2, 4)/2 = 2.
"""

from __future__ import annotations

import functools

from loongforge.models.vlm import mrope_index

get_rope_index = functools.partial(mrope_index.get_rope_index, frames_as_images=True)
position_ids_for = functools.partial(mrope_index.position_ids_for, frames_as_images=True)
