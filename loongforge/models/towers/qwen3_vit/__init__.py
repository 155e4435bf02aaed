"""Qwen3-VL's vision part: the ViT with learned, resampled position embeddings, its merger and
DeepStack's mergers (side feature sets for the first decoder layers).

encoder.py       Qwen3VLEncoder: the part as one ``VisionEncoder`` (training stage and encode alone)
vision.py        the ViT tower and the patch mergers
layer_specs.py   the tower's layer spec (the shared pre-norm block with LayerNorm pre-norms)
params.py        parameter counts by arithmetic
flops.py         FLOPs of a training micro-batch
hf_mapping.py    HF weight rows (the family adds the language model's)
configs.py       the tower's and the mergers' megatron TransformerConfigs
vision_facts.py  Qwen3VisionConfig: the vision facts (from ModelConfig or an HF vision_config)
"""

from loongforge.models.family import LazyFunction
from loongforge.models.parts import TowerPart
from loongforge.models.qwen_vl.smart_resize import smart_resize_images
from loongforge.models.towers.qwen3_vit import flops, params

PART = TowerPart("qwen3_vit", ("deepstack_mergers",), f"{__name__}.encoder:Qwen3VLEncoder", flops.encoder_flops,
                 params.encoder_parameters, smart_resize_images,
                 hf_rules=LazyFunction(f"{__name__}.hf_mapping:part_rules"),
                 saved_values=flops.saved_values, takes_videos=True)
