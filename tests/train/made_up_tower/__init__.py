"""A vision tower made up in the tests, from this folder alone: the proof that a tower joins loongforge
without a change under ``loongforge/`` (issue 50). A run names it by its import path,
``model.vision.arch=tests.train.made_up_tower``, with ``model.family=composition``.

What it is: every image squashed to one square of ``model.vision.image_size`` pixels cut into patches of
``model.vision.patch_size`` (16 here, no shipped tower's), ``model.vision.depth`` LayerNorm blocks (two in
the tests) over each image's patches, then a two-layer MLP to the language model's width, one token per
patch. The blocks and the projector are loongforge's own building blocks (a SigLIP-like stack); what makes
it a tower of its own is this folder: its image processing, its FLOP and parameter counts, its weight rows
and its ``PART``.

processing.py  the image processor (resize to the square, CLIP normalisation, patch rows)
encoder.py     the encoder (tower + projector) and its weight rows
counts.py      FLOPs and parameters, torch-free
"""

from loongforge.models.family import LazyFunction
from loongforge.models.parts import TowerPart
from tests.train.made_up_tower.counts import encoder_flops, encoder_parameters, problems, saved_values
from tests.train.made_up_tower.processing import square_images

PART = TowerPart(__name__, ("mlp",), f"{__name__}.encoder:MadeUpEncoder", encoder_flops, encoder_parameters,
                 square_images, hf_rules=LazyFunction(f"{__name__}.encoder:tower_rules"), saved_values=saved_values,
                 config_problems=problems)

# The settings of a run composed of it (on ``composition-tiny-small-vocab``'s decoder): two 64-wide blocks,
# 16-pixel patches of 64-pixel squares (16 tokens an image), the MLP projector.
SETTINGS = (
    f"model.vision.arch={__name__}", "model.vision.depth=2", "model.vision.hidden_size=64",
    "model.vision.intermediate_size=128", "model.vision.num_heads=4", "model.vision.patch_size=16",
    "model.vision.temporal_patch_size=1", "model.vision.image_size=64", "model.vision.window=null",
    "model.vision.hidden_act=gelu_pytorch_tanh", "model.vision.norm=layer",
    "model.projector.arch=mlp", "model.projector.spatial_merge_size=1", "model.projector.hidden_act=gelu",
)
