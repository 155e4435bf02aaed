"""What Qwen2.5-ViT needs of its settings, checked before anything is built (``TowerPart.config_problems``: one
line each naming the key and the fix; the window's own checks are ``config.vision_parts``'). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def problems(model_cfg: ModelConfig) -> list[str]:
    if model_cfg.vision.window is None:
        return ["model.vision.window is null: Qwen2.5-ViT attends inside windows; give model.vision.window's size "
                "(pixels) and fullatt_block_indexes (the blocks that see the whole image)."]
    return []
