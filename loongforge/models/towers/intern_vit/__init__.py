"""InternVL's vision part: InternViT (fixed-size tiles, a class token, learned absolute positions,
LayerNorm or RMSNorm blocks with layer scale, InternViT-6B's q/k norms) and the pixel-shuffle
projector (2 x 2 patches -> one token; ``models/projectors/pixel_shuffle_mlp.py``).

encoder.py      InternVLEncoder: the part as one ``VisionEncoder``
checks.py       the settings it is built from, checked before a run (``TowerPart.config_problems``)
vision.py       InternViT
layer_specs.py  the block: the shared pre-norm block with layer scale, LayerNorm/RMSNorm, q/k norms
params.py       parameter counts by arithmetic (the part's, and any HF InternViTConfig's)
flops.py        FLOPs of a training micro-batch; of n tiles of any HF InternViTConfig
hf_mapping.py   HF weight rows (the family adds the language model's); the HF shapes a config implies
config.py       InternViTConfig: the HF vision_config read and written; InternVL3.5-8B's and -38B's towers
processor.py    an image -> its tiles (transformers' InternVL processing, bit for bit), tokens per tile

A tile travels as the Qwen towers' media do: pixel rows [patches, C*p*p] (row-major within the
tile) and a grid (1, side, side) with a 2 x 2 merge, so measuring, packing, ``encoder_dp`` and
``encoder_cp`` deal tiles as they deal images.
"""

from loongforge.models.family import LazyFunction
from loongforge.models.parts import TowerPart
from loongforge.models.towers.intern_vit import checks, flops, params
from loongforge.models.towers.intern_vit.processor import tiled_images

PART = TowerPart("intern_vit", ("pixel_shuffle_mlp",), f"{__name__}.encoder:InternVLEncoder", flops.encoder_flops,
                 params.encoder_parameters, tiled_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"),
                 saved_values=flops.saved_values, config_problems=checks.problems)
