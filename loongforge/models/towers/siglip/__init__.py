"""SigLIP as a plain vision backbone (fixed-size square images, learned absolute positions, LayerNorm
blocks, the last layer's output) with the two-layer MLP projector, one token per patch. Any composition
can use it; LLaVA-OneVision adds its anyres processing and packing in its own folder.

encoder.py      SiglipEncoder: the part as one ``VisionEncoder``
checks.py       the settings it is built from, checked before a run (``TowerPart.config_problems``)
vision.py       SigLIP and the MLP projector
processor.py    an image -> one resized square
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (a family adds the language model's)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.flops import plain_block_saved_values
from loongforge.models.parts import TowerPart
from loongforge.models.towers.siglip import checks, flops, params
from loongforge.models.towers.siglip.processor import square_images

PART = TowerPart("siglip", ("mlp",), f"{__name__}.encoder:SiglipEncoder", flops.encoder_flops,
                 params.encoder_parameters, square_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"),
                 saved_values=plain_block_saved_values, config_problems=checks.problems)
