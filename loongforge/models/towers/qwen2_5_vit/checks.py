"""The settings Qwen2.5-ViT's windowed attention is built from, checked before anything is built
(``TowerPart.config_problems``: one line each naming the key and the fix). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def problems(model_cfg: ModelConfig) -> list[str]:
    vision, problems_found = model_cfg.vision, []
    bad_blocks = [i for i in vision.fullatt_block_indexes if not 0 <= i < vision.depth]
    if bad_blocks:
        problems_found.append(f"model.vision.fullatt_block_indexes has {bad_blocks} outside the {vision.depth} "
                              f"vision blocks; use indexes 0..{vision.depth - 1}.")
    merged_patch_px = vision.patch_size * model_cfg.projector.spatial_merge_size
    if vision.window_size is not None and (vision.window_size < 1 or vision.window_size % merged_patch_px):
        problems_found.append(f"model.vision.window_size={vision.window_size} px must be a multiple of patch_size x "
                              f"spatial_merge_size = {merged_patch_px} px so windows hold whole merged tokens.")
    return problems_found
