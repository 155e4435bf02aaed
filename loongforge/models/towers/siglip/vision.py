"""SigLIP's vision transformer and LLaVA's MLP projector, built from megatron-core layers.

An image (LLaVA-OneVision: the base image and each crop of its anyres grid) is a square of
``image_size`` pixels cut into ``(image_size // patch)^2`` patches, row-major (the Conv2d's valid
padding leaves the last ``image_size % patch`` pixels out): pixel rows [patches, C*p*p] and a grid
(1, side, side). Learned absolute positions are added to the patch embeddings, then ``depth``
megatron layers (LayerNorm pre-norms, tanh-GELU MLP) attend within each image. LLaVA-OneVision reads
the last layer's output (``vision_feature_layer = -1``, before SigLIP's post-layernorm, which it
never uses) and projects every patch: Linear + GELU + Linear to the language model's width.
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_specs import projector_mlp_submodules
from loongforge.models.layers.layer_backend import BlockModules
from loongforge.models.vlm.vision_common import (
    PackedTower,
    PatchEmbed,
    apply_mlp,
    packed_segments,
    square_media_count,
    square_side,
)


class VisionModel(PackedTower):
    """SigLIP: pixel rows [images * side^2, C*p*p] + grids -> patch features [images * side^2, hidden]."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, layer_spec: ModuleSpec,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config, pg_collection)
        vis = model_cfg.vision
        self.side = square_side(model_cfg.vision)
        self.patch_embed = PatchEmbed(vis.in_channels * vis.patch_size**2, vis.hidden_size, config.params_dtype,
                                      bias=True)
        self.pos_embed = torch.nn.Embedding(self.side**2, vis.hidden_size, dtype=config.params_dtype)
        self.build_layers(layer_spec, vis.depth)
        # SigLIP's final LayerNorm: in every checkpoint, never run by LLaVA-OneVision (it reads the last
        # layer's output). Carried frozen so that a converted checkpoint exports bit for bit.
        self.post_layernorm = torch.nn.LayerNorm(vis.hidden_size, eps=vis.rms_norm_eps, dtype=config.params_dtype)
        self.post_layernorm.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        images, patches = square_media_count(grid_thw, self.side, "SigLIP"), self.side**2
        hidden = self.patch_embed(pixel_values).view(images, patches, -1) + self.pos_embed.weight  # [n, N, h]
        segments = packed_segments(torch.arange(images + 1, dtype=torch.int32, device=hidden.device) * patches)
        hidden = hidden.reshape(images * patches, 1, -1)  # megatron's [s, b, h] with b = 1 (thd packing)
        for layer in self.layers:
            hidden = self.run_layer(layer, hidden, None, segments)
        return hidden[:, 0]


class MLPProjector(MegatronModule):
    """[P, vision hidden] -> [P, LM hidden]: Linear + GELU + Linear, column- then row-parallel over the
    vision TP group (the output whole on every rank)."""

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, tp_group: torch.distributed.ProcessGroup,
                 modules: BlockModules):
        super().__init__(config=config)
        self.mlp = MLP(config=config, submodules=projector_mlp_submodules(modules),
                       input_size=model_cfg.vision.hidden_size, tp_group=tp_group)

    def forward(self, patch_features: torch.Tensor) -> torch.Tensor:
        return apply_mlp(self.mlp, patch_features)
