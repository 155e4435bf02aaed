"""LLaVA-OneVision's vision part: SigLIP (fixed-size images, learned absolute positions, LayerNorm
blocks, the last layer's output) and the two-layer MLP projector, one token per patch, with its anyres
processing and packing (the base image, the crops unpadded to the image's proportions, a newline per
row) on top of these features.

encoder.py      LlavaOnevisionEncoder: the part as one ``VisionEncoder``; ``check`` of its settings
vision.py       SigLIP and the MLP projector
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (the family adds the language model's)
processor.py    anyres: an image -> its base image and crops, and its placeholder tokens
packing.py      anyres: an image's per-square features -> its placeholders' (unpadded, newlines)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.parts import TowerPart
from loongforge.models.towers.siglip import flops, params
from loongforge.models.towers.siglip.processor import anyres_images

PART = TowerPart("siglip", ("mlp",), f"{__name__}.encoder:LlavaOnevisionEncoder", flops.encoder_flops,
                 params.encoder_parameters, anyres_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"))
