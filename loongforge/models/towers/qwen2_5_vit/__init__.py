"""Qwen2.5-VL's vision part: the ViT with window attention and the RMSNorm patch merger.

encoder.py      Qwen2_5_VLEncoder: the part as one ``VisionEncoder`` (training stage and encode alone)
vision.py       the ViT tower (window attention, 2-D RoPE) and the patch merger
layer_specs.py  the tower's layer spec (the decoder block of ``models.decoder``, bidirectional)
params.py       parameter counts by arithmetic
flops.py        FLOPs of a training micro-batch
hf_mapping.py   HF weight rows (the family adds the language model's)
configs.py      ModelConfig -> the tower's and the merger's megatron TransformerConfigs
checks.py       its window attention required, checked before a run (``TowerPart.config_problems``)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.parts import TowerPart
from loongforge.models.qwen_vl.smart_resize import smart_resize_images
from loongforge.models.towers.qwen2_5_vit import checks, flops, params

PART = TowerPart("qwen2_5_vit", ("patch_merger",), f"{__name__}.encoder:Qwen2_5_VLEncoder", flops.encoder_flops,
                 params.encoder_parameters, smart_resize_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:tower_rules"),
                 saved_values=flops.saved_values, config_problems=checks.problems, takes_videos=True)
