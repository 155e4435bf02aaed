"""Qwen3-VL's vision encoder alone (ViT + merger + DeepStack's mergers), for ``loongforge encode``.

``build_towers`` makes the three towers for both the training model's first stage and the encoder
alone, under the same names and seeds, so their state-dict keys, checkpoint keys and initial weights
for a seed are the same. The encoder alone returns, per merged token, the merger's features followed
by each DeepStack level's (decoder layer order): [P / m^2, (1 + k) * h]; a model built without the
encoder splits stored rows the same way (``Qwen3VLModel.embed``). Built whole (vision TP 1).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig
from loongforge.models import initialization
from loongforge.models.decoder.build import single_rank_groups
from loongforge.models.layer_backend import BlockModules, block_modules, resolve_layer_backend
from loongforge.models.qwen3_vl import configs
from loongforge.models.qwen3_vl.vision_facts import Qwen3VisionConfig
from loongforge.models.qwen3_vl.layer_specs import vision_layer_spec
from loongforge.models.qwen3_vl.vision import MergerList, PatchMerger, VisionModel
from loongforge.models.vision_common import vision_pg_collection
from loongforge.parallel import mcore_patches


def build_towers(vision: Qwen3VisionConfig, vision_config: TransformerConfig, merger_config: TransformerConfig,
                 modules: BlockModules, tp_group, pgs: ProcessGroupCollection,
                 init_seed: Optional[int], cp_group=None) -> tuple[VisionModel, PatchMerger, MergerList]:
    """The ViT, its merger and DeepStack's mergers, each drawn from its own seeded stream.
    ``cp_group``: the CP group of this rank alone the ViT is built with (default ``pgs.cp``)."""
    with initialization.seeded(init_seed, "vision_model"):
        vision_model = VisionModel(vision_config, vision, vision_layer_spec(modules),
                                   vision_pg_collection(tp_group, pgs, cp_group))
    with initialization.seeded(init_seed, "projector"):
        projector = PatchMerger(merger_config, vision, tp_group, modules, postshuffle_norm=False)
    with initialization.seeded(init_seed, "deepstack_projectors"):
        deepstack_projectors = MergerList(PatchMerger(merger_config, vision, tp_group, modules, postshuffle_norm=True)
                                          for _ in vision.deepstack_visual_indexes)
    return vision_model, projector, deepstack_projectors


def encode_with(vision_model: VisionModel, projector: PatchMerger, deepstack_projectors: MergerList,
                vision: Qwen3VisionConfig, pixels: torch.Tensor,
                grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged features [P/m^2, h] and the k DeepStack feature sets [P/m^2, h], decoder layer order
    (the k-th DeepStack block, in block order, goes through its merger and after decoder layer k)."""
    patch_features, block_outputs = vision_model(pixels, grid_thw)
    order = [vision.deepstack_visual_indexes.index(block) for block in sorted(vision.deepstack_visual_indexes)]
    deepstack = [deepstack_projectors[merger](outputs) for merger, outputs in zip(order, block_outputs)]
    return projector(patch_features), deepstack


class Qwen3VisionEncoder(torch.nn.Module):
    """pixel rows [P, C*T*p*p] + grid_thw [n, 3] -> [P / m^2, (1 + k) * h]: the merger's features,
    then DeepStack's, concatenated per merged token."""

    def __init__(self, vision: Qwen3VisionConfig, vision_model: VisionModel, projector: PatchMerger,
                 deepstack_projectors: MergerList):
        super().__init__()
        self.vision = vision
        self.vision_model = vision_model
        self.projector = projector
        self.deepstack_projectors = deepstack_projectors
        self.merge_unit = vision.spatial_merge_size**2

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        features, deepstack = encode_with(self.vision_model, self.projector, self.deepstack_projectors,
                                          self.vision, pixel_values, grid_thw)
        return torch.cat([features, *deepstack], dim=-1)


def build_encoder(model_cfg: ModelConfig, *, params_dtype: torch.dtype, device: torch.device | str,
                  init_seed: Optional[int] = None,
                  group: Optional[torch.distributed.ProcessGroup] = None) -> Qwen3VisionEncoder:
    """The whole encoder on ``device``, with the initial weights ``build_model`` draws for
    ``init_seed``. Its layers run on ``group`` (a group of this rank alone), else on megatron's
    groups, which must be TP = PP = CP = 1."""
    vision = Qwen3VisionConfig.from_model_cfg(model_cfg)
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    if on_cpu:
        mcore_patches.apply_cpu()
    init_seed = torch.initial_seed() if init_seed is None else init_seed
    modules = block_modules(resolve_layer_backend(model_cfg.layer_backend, device, params_dtype))
    alone = single_rank_groups() if group is None else ProcessGroupCollection(tp=group, cp=group, pp=group)
    towers = build_towers(vision, configs.vision_config(vision, 1, params_dtype, on_cpu),
                          configs.merger_config(vision, 1, params_dtype, on_cpu), modules, alone.tp, alone, init_seed)
    return Qwen3VisionEncoder(vision, *towers).to(device).eval()
