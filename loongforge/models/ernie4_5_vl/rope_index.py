"""3-D rotary position ids of one ERNIE-4.5-VL sample (temporal, height, width): ``vlm.mrope_index``'s rule for
images, as transformers' ``Ernie4_5_VLMoeModel.get_rope_index`` numbers them (an image's tokens at its start
position plus their merged row and column, the text after it from ``start + max(rows, columns)``; the image
markers are text). The decoder's rotary layout of these ids is ``vlm.paired_mrope``'s.

Worked example: ``[t t <is> I I I I I I <ie> t]`` with one image of grid (1, 4, 6) (merged 2 x 3)::

    token     t  t  is  I  I  I  I  I  I  ie  t
    temporal  0  1  2   3  3  3  3  3  3  6   7
    height    0  1  2   3  3  3  4  4  4  6   7
    width     0  1  2   3  4  5  3  4  5  6   7
"""

from __future__ import annotations

import functools

from loongforge.models.vlm import mrope_index

position_ids_for = functools.partial(mrope_index.position_ids_for, frames_as_images=False)
