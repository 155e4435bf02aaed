"""The settings SigLIP is built from, checked before anything is built (``TowerPart.config_problems``: one
line each naming the key and the fix). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def problems(model_cfg: ModelConfig) -> list[str]:
    vis, problems_found = model_cfg.vision, []
    if vis.image_size is None or vis.image_size < vis.patch_size:
        problems_found.append(f"model.vision.image_size={vis.image_size}: SigLIP needs the image side in pixels "
                              "(384 for so400m-patch14-384); set it")
    if vis.norm != "layer":
        problems_found.append(f"model.vision.norm={vis.norm!r}: SigLIP's blocks use LayerNorm; set "
                              "model.vision.norm=layer")
    if model_cfg.projector.spatial_merge_size != 1:
        problems_found.append(f"model.projector.spatial_merge_size={model_cfg.projector.spatial_merge_size}: the MLP "
                              "projector maps every patch to a token; set it to 1")
    return problems_found
