"""A VLM's vision side as one module (``VisionEncoder``), and how it is built.

A family's vision part (its tower, its projector, and any side projectors such as Qwen3-VL's
DeepStack mergers) is a ``VisionEncoder``: pixels and grids in, one row of features per merged
token out. The same object serves training and ``loongforge encode``: the composed model
(``vlm.model.VisionLanguageModel``) adopts its children under their own names (``vision_model``,
``projector``, ...), so checkpoint keys, HF weight rows and the initial weights for a seed are the
same whether the encoder runs inside a training stage or alone.

The features are ``[n, width]`` with ``width = (1 + side_sets) x LM hidden``: the merged features
written over the placeholders, then ``side_sets`` feature sets that the language model adds after
its first ``side_sets`` layers (``vlm.deepstack``); ``side_sets = 0`` for most towers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from loongforge.config.schema import ModelConfig
from loongforge.models import parts
from loongforge.models.layers import initialization
from loongforge.models.media import MediaSet
from loongforge.models.decoder.build import single_rank_groups
from loongforge.models.layers.layer_backend import (
    BlockModules,
    block_modules,
    resolve_layer_backend,
)
from loongforge.models.vlm.vision_common import vision_pg_collection
from loongforge.parallel import mcore_patches


class VisionEncoder(torch.nn.Module, abc.ABC):
    """pixel rows + grid_thw [n, 3] -> features [P / merge_unit, width] (merged, then side sets).

    Subclasses set the class attributes and build their children in ``__init__``; ``forward`` must
    not depend on ``self.training``: inside a training stage this object is not a registered module
    (its children are), so only the children follow ``train()`` / ``eval()``."""

    # Children that ``training.freeze_vision`` / ``freeze_projector`` name, in build order.
    vision_parts: tuple[str, ...] = ("vision_model",)
    projector_parts: tuple[str, ...] = ("projector",)
    # Whether it reads more of an image than its rows and grid (its size, its processor's facts:
    # ``encode_images`` takes the whole ``MediaSet``); such an encoder runs whole images where it is, never
    # shared over TP, CP or the model-parallel group (sharing divides rows and grids only).
    reads_items: bool = False

    @classmethod
    def feature_rows(cls, model_cfg: ModelConfig, images: Optional[MediaSet], merge_unit: int) -> Optional[int]:
        """Feature rows ``images`` give, where an encoder gives them otherwise than one row per
        ``merge_unit`` patches; None: that rule."""
        return None

    def encode_images(self, images: MediaSet) -> torch.Tensor:
        """Features [rows, width] of a set of images (``feature_rows`` of them): the forward of their rows
        and grids, unless the encoder ``reads_items``."""
        return self(images.rows, images.grids)

    def __init__(self, *, merge_unit: int, out_hidden: int, side_sets: int = 0):
        super().__init__()
        self.merge_unit = merge_unit  # patches per merged token (one placeholder)
        self.out_hidden = out_hidden  # the language model's hidden size
        self.side_sets = side_sets

    @property
    def width(self) -> int:
        return (1 + self.side_sets) * self.out_hidden

    @classmethod
    @abc.abstractmethod
    def build(cls, build: "EncoderBuild") -> "VisionEncoder":
        """The encoder at ``build``'s layout, each child drawn from its own seeded stream
        (``models.layers.initialization``), children built in the order of ``vision_parts`` then
        ``projector_parts`` (the order of their parameters in the model)."""


class TowerThenProjector(VisionEncoder):
    """The common vision part: a tower (``vision_model``: rows + grids -> patch features) then a projector to the
    language model's width (``projector``: merging ``merge_unit`` patches into a token, or one token each)."""

    def __init__(self, vision_model: torch.nn.Module, projector: torch.nn.Module, model_cfg: ModelConfig, *,
                 merge_unit: int):
        super().__init__(merge_unit=merge_unit, out_hidden=model_cfg.projector.out_hidden_size)
        self.vision_model = vision_model
        self.projector = projector

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vision_model(pixel_values, grid_thw))  # [P / merge_unit, LM hidden]


@dataclass(frozen=True)
class EncoderBuild:
    """What a vision part is built with, at any layout (the same call builds a training stage's
    encoder and ``loongforge encode``'s)."""

    model_cfg: ModelConfig
    vision_tp: int  # the tensor-parallel size of the tower and projector
    tp_group: torch.distributed.ProcessGroup  # the vision TP group (of vision_tp ranks)
    # The groups the tower's layers are built with: tp_group, a CP group of this rank alone (an image
    # is never split over CP ranks), the language model's PP group (``vision_common.vision_pg_collection``).
    pgs: ProcessGroupCollection
    modules: BlockModules
    params_dtype: torch.dtype
    on_cpu: bool
    recompute: bool
    init_seed: Optional[int]


def refuse(problems: list[str]) -> None:
    """A part's settings problems (``TowerPart.config_problems``) as one ValueError, where a part is built
    without a run's checks before it (``loongforge encode``, a test)."""
    if problems:
        raise ValueError("; ".join(problems))


def seeded_parts(init_seed: Optional[int], **makers: Callable[[], torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Each part made under the seeded stream of its own name (``models.layers.initialization``), in the
    order given: the same initial weights at every layout, alone or in a training stage."""
    made = {}
    for name, make in makers.items():
        with initialization.seeded(init_seed, name):
            made[name] = make()
    return made


# EncoderBuild -> the VisionEncoder (tower, projector, side projectors), each child drawn from the
# seeded stream of its own name (``models.layers.initialization``).
BuildVisionEncoder = Callable[[EncoderBuild], VisionEncoder]


def build_encoder_alone(build: BuildVisionEncoder, model_cfg: ModelConfig, *, params_dtype: torch.dtype,
                        device: torch.device | str, init_seed: Optional[int] = None,
                        group: Optional[torch.distributed.ProcessGroup] = None) -> VisionEncoder:
    """The whole encoder (vision TP 1) on ``device`` in eval mode, with the initial weights a training
    stage draws for ``init_seed`` (on the CPU; default ``torch.initial_seed()``). Its layers run on
    ``group`` (a group of this rank alone, e.g. inside a training job), else on megatron's groups,
    which must then be TP = PP = CP = 1 (a process of its own, as in ``loongforge encode``)."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    if on_cpu:
        mcore_patches.apply_cpu()
    alone = single_rank_groups() if group is None else ProcessGroupCollection(tp=group, cp=group, pp=group)
    encoder = build(EncoderBuild(
        model_cfg=model_cfg, vision_tp=1, tp_group=alone.tp, pgs=vision_pg_collection(alone.tp, alone),
        modules=block_modules(resolve_layer_backend(model_cfg.layer_backend, device, params_dtype), device),
        params_dtype=params_dtype, on_cpu=on_cpu, recompute=False,
        init_seed=torch.initial_seed() if init_seed is None else init_seed))
    return encoder.to(device).eval()


def build_part_encoder(encoder: str, model_cfg: ModelConfig, **options) -> VisionEncoder:
    """The whole encoder ``encoder`` ("module:Class", ``TowerPart.encoder``) alone (``build_encoder_alone``'s
    ``options``): a family's ``build_encoder`` binds its vision part's."""
    return build_encoder_alone(parts.encoder_type(encoder).build, model_cfg, **options)
