"""The settings ERNIE-4.5-VL's ViT and resampler are built from, checked before anything is built
(``TowerPart.config_problems``: one line each naming the key and the fix). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def problems(model_cfg: ModelConfig) -> list[str]:
    vis, proj, found = model_cfg.vision, model_cfg.projector, []
    if vis.norm != "layer":
        found.append(f"model.vision.norm={vis.norm!r}: ERNIE-4.5-VL's ViT blocks use LayerNorm; set model.vision.norm=layer")
    if vis.window is not None:
        found.append("model.vision.window is set: ERNIE-4.5-VL's ViT attends over each whole frame; set "
                     "model.vision.window=null")
    if not vis.qkv_bias or vis.qk_norm:
        found.append("model.vision.qkv_bias / qk_norm: ERNIE-4.5-VL's ViT has a qkv bias and no q/k norm; set "
                     "qkv_bias=true, qk_norm=false")
    if proj.spatial_merge_size < 1 or (vis.hidden_size // vis.num_heads) % 4:
        found.append(f"model.vision.hidden_size / num_heads = {vis.hidden_size // vis.num_heads}: the 2-D rotary "
                     f"gives a quarter of each head's channels to rows and a quarter to columns; use a head width "
                     f"divisible by 4")
    return found
