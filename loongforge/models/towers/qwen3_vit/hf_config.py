"""The tower's ``vision_config`` of an HF config.json, both ways: Qwen3-VL's (with DeepStack taps) and
Qwen3.5's (the same tower without them) read and write it alike."""

from __future__ import annotations

from typing import Any, Mapping

from loongforge.config.schema import ModelConfig, ProjectorConfig, VisionConfig


def tower_from_hf(vision: Mapping[str, Any]) -> tuple[VisionConfig, ProjectorConfig]:
    """``model.vision`` and ``model.projector`` from a ``vision_config`` dict; KeyError for a missing
    required key (the family names the file)."""
    return VisionConfig(
        arch="qwen3_vit",
        depth=vision["depth"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"],
        in_channels=vision.get("in_channels", 3), patch_size=vision.get("patch_size", 16),
        temporal_patch_size=vision.get("temporal_patch_size", 2),
        hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
        norm="layer", window=None, num_position_embeddings=vision["num_position_embeddings"],
        deepstack_layers=list(vision.get("deepstack_visual_indexes", [])),
        # The processor's normalisation (preprocessor_config.json, not config.json): 0.5 / 0.5.
        pixel_mean=[0.5, 0.5, 0.5], pixel_std=[0.5, 0.5, 0.5],
    ), ProjectorConfig(arch="deepstack_mergers", spatial_merge_size=vision.get("spatial_merge_size", 2),
                       hidden_act="gelu", out_hidden_size=vision["out_hidden_size"])


def tower_to_hf(model_cfg: ModelConfig, model_type: str, *, deepstack: bool = True) -> dict[str, Any]:
    """The ``vision_config`` dict of ``model_cfg``'s tower (``deepstack``: with the taps' key, which
    Qwen3.5's config class does not have)."""
    vis, proj = model_cfg.vision, model_cfg.projector
    config = {
        "model_type": model_type, "depth": vis.depth, "hidden_size": vis.hidden_size,
        "intermediate_size": vis.intermediate_size, "num_heads": vis.num_heads, "in_channels": vis.in_channels,
        "patch_size": vis.patch_size, "temporal_patch_size": vis.temporal_patch_size,
        "spatial_merge_size": proj.spatial_merge_size, "out_hidden_size": proj.out_hidden_size,
        "num_position_embeddings": vis.num_position_embeddings, "hidden_act": vis.hidden_act,
    }
    if deepstack:
        config["deepstack_visual_indexes"] = list(vis.deepstack_layers)
    return config
