"""The settings InternViT is built from, checked before anything is built (``TowerPart.config_problems``: one
line each naming the key and the fix). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig

# model.vision.norm -> megatron's normalization of the blocks' pre-norms.
NORMALIZATION = {"layer": "LayerNorm", "rms": "RMSNorm"}


def problems(model_cfg: ModelConfig) -> list[str]:
    vis, proj, problems_found = model_cfg.vision, model_cfg.projector, []
    if vis.image_size is None or vis.image_size % vis.patch_size or (vis.image_size // vis.patch_size) % 2:
        problems_found.append(f"model.vision.image_size={vis.image_size}: InternViT needs the tile side in pixels, an "
                              f"even number of model.vision.patch_size={vis.patch_size} patches (448 for InternVL3.5)")
    if vis.norm not in NORMALIZATION:
        problems_found.append(f"model.vision.norm={vis.norm!r}: InternViT's blocks use LayerNorm (layer, "
                              "InternViT-300M) or RMSNorm (rms, InternViT-6B); set one of them")
    if proj.spatial_merge_size != 2:
        problems_found.append(f"model.projector.spatial_merge_size={proj.spatial_merge_size}: InternVL's pixel shuffle "
                              "merges 2 x 2 patches (downsample ratio 0.5); set it to 2")
    return problems_found
