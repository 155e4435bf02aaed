"""RICE-ViT, the tower of LLaVA-OneVision-1.5: a plain ViT over native-resolution images (Conv2d patch
embedding without bias, Qwen's 2-D vision RoPE, a learned class token with a learned rotary angle per
frame, a LayerNorm before the blocks, LayerNorm blocks with a plain GELU MLP) and its patch merger
(LayerNorm per patch, then the 2 x 2 shuffle and an MLP to the language model's width).

encoder.py      RiceViTEncoder: the part as one ``VisionEncoder``
checks.py       the settings it is built from, checked before a run (``TowerPart.config_problems``)
vision.py       the tower and the patch merger
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (a family adds the language model's)
processor.py    its image processing: Qwen2-VL's smart resize, one frame a temporal patch (videos: the family's)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.flops import plain_block_saved_values
from loongforge.models.parts import TowerPart
from loongforge.models.towers.rice_vit import checks, flops, params
from loongforge.models.towers.rice_vit.processor import rice_images

PART = TowerPart("rice_vit", ("patch_merger",), f"{__name__}.encoder:RiceViTEncoder", flops.encoder_flops,
                 params.encoder_parameters, rice_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"),
                 saved_values=plain_block_saved_values, config_problems=checks.problems, takes_videos=True)
