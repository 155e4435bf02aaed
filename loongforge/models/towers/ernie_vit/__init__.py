"""ERNIE-4.5-VL's vision part: a Qwen2-VL-style ViT (LayerNorm blocks, quick-GELU MLP, 2-D rotary, a final
LayerNorm) and the variable-resolution resampler (spatial then temporal merge, to the language model's width).
Its images are smart-resized like Qwen-VL's (multiples of patch x merge pixels), one temporal slot per patch.

encoder.py      ErnieVisionEncoder: the part as one ``VisionEncoder``
checks.py       the settings it is built from, checked before a run
vision.py       the ViT and the resampler
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (a family adds the language model's)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.flops import plain_block_saved_values
from loongforge.models.parts import TowerPart
from loongforge.models.qwen_vl.smart_resize import smart_resize_images
from loongforge.models.towers.ernie_vit import checks, flops, params

PART = TowerPart("ernie_vit", ("resampler",), f"{__name__}.encoder:ErnieVisionEncoder", flops.encoder_flops,
                 params.encoder_parameters, smart_resize_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"),
                 saved_values=plain_block_saved_values, config_problems=checks.problems)
