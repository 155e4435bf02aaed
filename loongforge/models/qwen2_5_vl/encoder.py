"""The vision encoder alone (ViT + patch merger), for ``loongforge encode`` and its checks.

``VisionEncoder`` holds the same two towers as a first pipeline stage of ``Qwen2_5_VLModel``, under
the same attribute names (``vision_model``, ``projector``), so its state-dict keys, its checkpoint
keys and its initial weights for a seed are the training model's: embeddings computed with it are
the features training would compute with the same weights. Built whole (vision TP 1).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from loongforge.config.schema import ModelConfig
from loongforge.models import initialization
from loongforge.models.decoder.build import single_rank_groups
from loongforge.models.layer_backend import block_modules, resolve_layer_backend
from loongforge.models.qwen2_5_vl import configs
from loongforge.models.qwen2_5_vl.layer_specs import vision_layer_spec
from loongforge.models.qwen2_5_vl.vision import PatchMerger, VisionModel, vision_pg_collection
from loongforge.parallel import mcore_patches


class VisionEncoder(torch.nn.Module):
    """pixel rows [P, C*T*p*p] + grid_thw [n, 3] -> merged features [P / m^2, out_hidden]."""

    def __init__(self, vision_model: VisionModel, projector: PatchMerger, merge_unit: int):
        super().__init__()
        self.vision_model = vision_model
        self.projector = projector
        self.merge_unit = merge_unit

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_model(pixel_values, grid_thw))


def build_encoder(model_cfg: ModelConfig, *, params_dtype: torch.dtype, device: torch.device | str,
                  init_seed: Optional[int] = None,
                  group: Optional[torch.distributed.ProcessGroup] = None) -> VisionEncoder:
    """The whole encoder on ``device``; initial weights as ``build_model`` draws them for
    ``init_seed`` (on the CPU). Its layers need process groups of this rank alone: ``group`` (a
    group of one, e.g. inside a training job), else megatron's own at TP = PP = CP = 1 (a process
    of its own, as in ``loongforge encode``)."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    if on_cpu:
        mcore_patches.apply_cpu()
    init_seed = torch.initial_seed() if init_seed is None else init_seed
    modules = block_modules(resolve_layer_backend(model_cfg.layer_backend, device, params_dtype))
    alone = single_rank_groups() if group is None else ProcessGroupCollection(tp=group, cp=group, pp=group)
    with initialization.seeded(init_seed, "vision_model"):
        vision_model = VisionModel(configs.vision_config(model_cfg, 1, params_dtype, on_cpu), model_cfg,
                                   vision_layer_spec(modules), vision_pg_collection(alone.tp, alone))
    with initialization.seeded(init_seed, "projector"):
        projector = PatchMerger(configs.projector_config(model_cfg, 1, params_dtype, on_cpu), model_cfg,
                                alone.tp, modules)
    encoder = VisionEncoder(vision_model, projector, model_cfg.projector.spatial_merge_size**2)
    return encoder.to(device).eval()
