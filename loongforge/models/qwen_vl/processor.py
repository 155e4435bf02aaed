"""The processor files of a Qwen-VL HF folder (Qwen2.5-VL, Qwen3-VL) at a run's data settings.

transformers 5 saves a processor as one ``processor_config.json``: each sub-processor's settings
nested under its attribute name (``image_processor``, ``video_processor``) plus ``processor_class``;
the tokenizer and chat template go to files of their own (``convert.serving`` writes those). Both
families use transformers' Qwen2-VL image processor, at their own patch size and normalisation;
their video processors differ (``Qwen2VLVideoProcessor``, ``Qwen3VLVideoProcessor``).

The image processor's settings are transformers' own serialisation of the processor built at the
run's sizes. The video processor's are written from its settings instead: transformers' video
processors need torchvision, which has no build for every torch (this project's CPU one among
them), and an export must not depend on it.
"""

from __future__ import annotations

import json

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.models.media import SECONDS_PER_GRID_T

PROCESSOR_CONFIG = "processor_config.json"
# Frames a video processor samples at least (transformers' default; ``video.py`` samples the same).
MIN_VIDEO_FRAMES = 4


def qwen_vl_processor_files(model_cfg: ModelConfig, data_cfg: DataConfig, *, processor_class: str,
                            video_processor_class: str) -> dict[str, dict]:
    """``processor_config.json`` of a processor ``processor_class`` whose video processor is
    ``video_processor_class`` (``ModelFamily.hf_processor_files``)."""
    return {PROCESSOR_CONFIG: {
        "image_processor": image_processor_config(model_cfg, data_cfg),
        "video_processor": video_processor_config(model_cfg, data_cfg, video_processor_class),
        "processor_class": processor_class,
    }}


def qwen_vl_model_inputs(model_cfg: ModelConfig, inputs: dict) -> dict:
    """transformers' Qwen-VL forward inputs (``ModelFamily.hf_model_inputs``): the batch's patch rows and
    grids as they are (``models.media.MediaBatch``), the videos' seconds per temporal patch, and each
    token's modality (``mm_token_type_ids``), which the processor returns."""
    ids, tokens, media = inputs["input_ids"], model_cfg.tokens, inputs["media"]
    given = {}
    if media.images is not None:
        given.update(pixel_values=media.images.rows, image_grid_thw=media.images.grids)
    if media.videos is not None:
        given.update(pixel_values_videos=media.videos.rows, video_grid_thw=media.videos.grids,
                     second_per_grid_ts=media.videos.facts[SECONDS_PER_GRID_T])
    kinds = (ids == tokens.image_token_id).long() + 2 * (ids == tokens.video_token_id).long()
    return {"input_ids": ids, **given, "mm_token_type_ids": kinds}


def image_processor_config(model_cfg: ModelConfig, data_cfg: DataConfig) -> dict:
    """transformers' Qwen2-VL image processor at the run's image sizes and patch geometry, as it
    serialises itself (the PIL backend: the one ``data.vision`` is bit-equal to, and the one
    transformers picks where torchvision is missing)."""
    # lazy: transformers (~1.5 s) only to write processor files
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(**_patch_geometry(model_cfg), min_pixels=data_cfg.min_pixels,
                                         max_pixels=data_cfg.max_pixels)
    return json.loads(processor.to_json_string())


def video_processor_config(model_cfg: ModelConfig, data_cfg: DataConfig, video_processor_class: str) -> dict:
    """The video processor's settings that loongforge's data pipeline fixes: pixel bounds (per
    frame for Qwen2.5-VL, per clip for Qwen3-VL: each class reads ``size`` by its own rule, as
    ``data.vision`` does), patch geometry, normalisation and frame sampling; every other setting
    is the class's default."""
    return {
        **_patch_geometry(model_cfg),
        "size": {"shortest_edge": data_cfg.video_min_pixels, "longest_edge": data_cfg.video_max_pixels},
        # loongforge samples frames itself at data.video_fps; a served model must see the same.
        "do_sample_frames": True,
        "fps": data_cfg.video_fps,
        "min_frames": MIN_VIDEO_FRAMES,
        "max_frames": data_cfg.video_max_frames,
        # data.vision sizes a video by its pixel bounds alone; transformers would otherwise warn
        # that its per-frame cap (off today) is to become the default.
        "cap_pixels_per_frame": False,
        "video_processor_type": video_processor_class,
    }


def _patch_geometry(model_cfg: ModelConfig) -> dict:
    vision = model_cfg.vision
    return {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": model_cfg.projector.spatial_merge_size,
            "image_mean": list(vision.pixel_mean), "image_std": list(vision.pixel_std)}
