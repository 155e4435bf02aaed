"""The vision parts a VLM is composed of, by ``model.vision.arch``: each a folder under
``models/towers/`` exporting ``PART``. Adding a tower is its folder and one line in ``_TOWERS``; a
family names the tower it composes (``ModelFamily.vision_part``) and the run's ``model.vision.arch``
/ ``model.projector.arch`` are checked against it (``composition_problems``).

Torch-free: a part's FLOP count and facts are read by plans that build no model; its encoder
module is named, and imported when built.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from loongforge.config.errors import ConfigError
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.decoder.params import model_parameters
from loongforge.models.family import LazyFunction, ModelFamily, registered
from loongforge.models.flops import EncoderFlops, vlm_training_flops
from loongforge.models.media import ImageProcessing


def no_problems(model_cfg: ModelConfig) -> list[str]:
    """``TowerPart.config_problems`` of a tower that any settings of its fields build."""
    return []


@dataclass(frozen=True)
class TowerPart:
    """One vision tower with the projectors it is built with."""

    arch: str  # the ``model.vision.arch`` value that names it
    # ``model.projector.arch`` values this tower's encoder builds (the first is its default)
    projectors: tuple[str, ...]
    # "module:Class" of its ``VisionEncoder`` (the tower and projector as one module)
    encoder: str
    # (model_cfg, media grids, options) -> (vision, projector) FLOPs of a micro-batch
    flops: EncoderFlops
    # model_cfg -> (vision, projector) parameter counts
    parameters: Callable[[ModelConfig], tuple[int, int]]
    # (model_cfg, data_cfg) -> its image processor at the run's settings (``models.media``)
    images: Callable[[ModelConfig, DataConfig], ImageProcessing]
    # model_cfg -> its HF weight rows (a ``LazyFunction``: the rows need torch, the registry does not)
    hf_rules: Callable[[ModelConfig], list]
    # (model_cfg, vision TP) -> the values one of its blocks saves for the backward per patch (the dry run's
    # activation estimate; ``models.flops.vision_block_saved_values``)
    saved_values: Callable[[ModelConfig, int], float]
    # model_cfg -> one-line problems (the key, its value and the fix) of settings it cannot be built with,
    # checked with the run's config before anything is launched; [] when it builds
    config_problems: Callable[[ModelConfig], list[str]] = no_problems
    # Whether its processing takes videos (the Qwen towers'; the others see images only)
    takes_videos: bool = False

    def encoder_type(self) -> type:
        """The tower's ``models.vlm.encoder.VisionEncoder`` subclass, imported now (it needs
        megatron-core; the registry does not, so it names no encoder module at import)."""
        return encoder_type(self.encoder)


def encoder_type(encoder: str) -> type:
    """The ``VisionEncoder`` subclass a "module:Class" path names, imported now."""
    module_name, _, class_name = encoder.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


# model.vision.arch -> the package whose PART it is
_TOWERS: dict[str, str] = {
    "ernie_vit": "loongforge.models.towers.ernie_vit",
    "intern_vit": "loongforge.models.towers.intern_vit",
    "qwen2_5_vit": "loongforge.models.towers.qwen2_5_vit",
    "qwen3_vit": "loongforge.models.towers.qwen3_vit",
    "rice_vit": "loongforge.models.towers.rice_vit",
    "siglip": "loongforge.models.towers.siglip",
}


def towers() -> list[str]:
    return sorted(_TOWERS)


def tower(arch: str, key: str = "model.vision.arch") -> TowerPart:
    """The tower ``arch``: a name of ``_TOWERS``, or the import path of a package outside loongforge that
    exports ``PART`` (``mypackage.my_tower``: a tower of one's own, with no change to loongforge; every rank
    imports it by that path). A one-line ConfigError naming ``key`` (and the nearest name) if neither."""
    if arch not in _TOWERS and "." in str(arch):
        return _tower_outside(arch, key)
    return registered(_TOWERS, arch, key, lambda choices: f"a vision tower of loongforge ({choices})").PART


def _tower_outside(path: str, key: str) -> TowerPart:
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as missing:
        raise ConfigError(f"{key}={path}: no module {missing.name!r} to import; give a tower of loongforge "
                          f"({' | '.join(towers())}) or the import path of a package exporting PART") from None
    part = getattr(module, "PART", None)
    if not isinstance(part, TowerPart) or part.arch != path:
        raise ConfigError(f"{key}={path}: the module exports no PART = TowerPart(arch={path!r}, ...); export one")
    return part


def composition_problems(model_cfg: ModelConfig, family_name: str, family_tower: Optional[str],
                         any_tower: str = "") -> list[str]:
    """What is wrong with the run's ``model.vision.arch`` / ``model.projector.arch`` for a family that
    composes ``family_tower`` (None: a text-only family; ``any_tower``: whichever the run names), one line
    each; [] when they fit."""
    vision_arch = model_cfg.vision.arch if model_cfg.vision is not None else None
    projector_arch = model_cfg.projector.arch if model_cfg.projector is not None else None
    if family_tower is not None and family_tower == any_tower:
        if vision_arch is None:
            return [f"model.vision.arch: model.family={family_name} is composed of the tower the run names; set "
                    f"model.vision.arch to one of {' | '.join(towers())}"]
        family_tower = vision_arch
    if family_tower is None:
        given = [f"model.{key}.arch={value!r}" for key, value in (("vision", vision_arch), ("projector", projector_arch))
                 if value is not None]
        return [f"{', '.join(given)}: model.family={family_name} is a text-only family; unset them"] if given else []
    problems = []
    if vision_arch is not None and vision_arch != family_tower:
        tower(vision_arch)  # an unknown name is its own error
        problems.append(f"model.vision.arch={vision_arch!r}: model.family={family_name} is composed of the "
                        f"{family_tower!r} tower; set model.vision.arch={family_tower} or leave it null")
    projectors = tower(family_tower).projectors
    if projector_arch is not None and projector_arch not in projectors:
        problems.append(f"model.projector.arch={projector_arch!r}: the {family_tower!r} tower is built with "
                        f"{' | '.join(projectors)}; set model.projector.arch={projectors[0]} or leave it null")
    return problems


def composed_fields(part: TowerPart) -> dict:
    """The ``ModelFamily`` fields of a VLM family composed of ``part``: its tower, its image processing, the
    encoder alone for
    ``loongforge encode`` (imported at its first build: megatron-core takes seconds), and the parameter
    and FLOP counts as the tower's plus the shared decoder's."""
    return dict(vision_part=part.arch, image_processing=part.images,
                build_encoder=functools.partial(LazyFunction("loongforge.models.vlm.encoder:build_part_encoder"),
                                                part.encoder),
                count_parameters=functools.partial(composed_parameters, part.parameters),
                training_flops=functools.partial(vlm_training_flops, part.flops))


def image_processing(family: ModelFamily, model_cfg: ModelConfig, data_cfg: DataConfig) -> ImageProcessing:
    """The image processor of a run of ``family`` at its settings: the family's own, else its tower's."""
    images = family.image_processing or tower(family.tower(model_cfg)).images
    return images(model_cfg, data_cfg)


def composed_parameters(tower_parameters: Callable[[ModelConfig], tuple[int, int]],
                        model_cfg: ModelConfig) -> dict[str, int]:
    """A VLM family's ``count_parameters`` (bind its tower's ``parameters``): the tower's and the
    projector's counts with the shared decoder's (``decoder.params.model_parameters``)."""
    return model_parameters(model_cfg, *tower_parameters(model_cfg))
