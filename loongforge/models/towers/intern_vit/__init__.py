"""InternVL's vision part: InternViT (fixed-size tiles, a class token, learned absolute positions,
LayerNorm blocks with layer scale) and the pixel-shuffle projector (2 x 2 patches -> one token).

encoder.py      InternVLEncoder: the part as one ``VisionEncoder``; ``check`` of its settings
vision.py       InternViT and the pixel-shuffle projector
layer_specs.py  the block: the shared pre-norm block with LayerNorm pre-norms and layer scale
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (the family adds the language model's)
processor.py    an image -> its tiles (transformers' InternVL processing, bit for bit), tokens per tile

A tile travels as the Qwen towers' media do: pixel rows [patches, C*p*p] (row-major within the
tile) and a grid (1, side, side) with a 2 x 2 merge, so measuring, packing, ``encoder_dp`` and
``encoder_cp`` deal tiles as they deal images.
"""

from loongforge.models.parts import TowerPart
from loongforge.models.towers.intern_vit import flops, params

PART = TowerPart("intern_vit", ("pixel_shuffle_mlp",), f"{__name__}.encoder:InternVLEncoder", flops.encoder_flops,
                 params.encoder_parameters)
