"""The settings RICE-ViT is built from, checked before anything is built (``TowerPart.config_problems``: one
line each naming the key and the fix). Torch-free."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def problems(model_cfg: ModelConfig) -> list[str]:
    vis, found = model_cfg.vision, []
    if vis.norm != "layer":
        found.append(f"model.vision.norm={vis.norm!r}: RICE-ViT's blocks use LayerNorm; set model.vision.norm=layer")
    if vis.temporal_patch_size != 1:
        found.append(f"model.vision.temporal_patch_size={vis.temporal_patch_size}: RICE-ViT embeds each frame on its "
                     "own (a Conv2d); set it to 1")
    if vis.window is not None:
        found.append("model.vision.window is set: every RICE-ViT block sees the whole image; set it to null")
    if vis.num_position_embeddings is not None or vis.deepstack_layers or vis.image_size is not None:
        found.append("model.vision.num_position_embeddings / deepstack_layers / image_size: RICE-ViT has no learned "
                     "position table, no DeepStack taps and takes any image size; leave them null / []")
    if not vis.qkv_bias or vis.qk_norm:
        found.append("model.vision.qkv_bias / qk_norm: RICE-ViT's q, k, v have biases and no norm; leave them at "
                     "true / false")
    if vis.hidden_size % (4 * vis.num_heads):
        found.append(f"model.vision.hidden_size={vis.hidden_size}: its 2-D rotary embedding gives a quarter of each "
                     f"head to rows and a quarter to columns; use a multiple of 4 x num_heads ({4 * vis.num_heads})")
    return found
