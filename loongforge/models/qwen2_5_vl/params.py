"""Parameter counts of Qwen2.5-VL by arithmetic on the config: no tensors are allocated.

Counts use the true vocabulary (as published), not megatron's TP padding. Tied embeddings are
counted once.
"""

from __future__ import annotations

from loongforge.config.schema import ModelConfig


def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def vision_layer_parameters(model_cfg: ModelConfig) -> int:
    """One ViT block: 2 RMSNorms, fused qkv + proj (with biases), SwiGLU MLP (with biases)."""
    h, ffn = model_cfg.vision.hidden_size, model_cfg.vision.intermediate_size
    norms = 2 * h
    attention = _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True)
    mlp = 2 * _linear(h, ffn, bias=True) + _linear(ffn, h, bias=True)
    return norms + attention + mlp


def language_layer_parameters(model_cfg: ModelConfig) -> int:
    """One decoder layer: 2 RMSNorms, GQA attention (qkv bias, no o_proj bias), SwiGLU MLP."""
    lang = model_cfg.language
    h, ffn = lang.hidden_size, lang.ffn_hidden_size
    kv_width = lang.num_query_groups * (h // lang.num_attention_heads)
    norms = 2 * h
    q_and_kv = _linear(h, h, lang.add_qkv_bias) + 2 * _linear(h, kv_width, lang.add_qkv_bias)
    attention = q_and_kv + _linear(h, h, bias=False)  # o_proj has no bias
    mlp = 3 * _linear(h, ffn, bias=False)
    return norms + attention + mlp


def count_parameters(model_cfg: ModelConfig) -> dict[str, int]:
    """{"vision_model", "projector", "language_model", "total"} parameter counts."""
    vis, lang = model_cfg.vision, model_cfg.language
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    vision_model = patch_dim * vis.hidden_size + vis.depth * vision_layer_parameters(model_cfg)

    merged = vis.hidden_size * model_cfg.projector.spatial_merge_size**2
    projector = (
        vis.hidden_size  # ln_q
        + _linear(merged, merged, bias=True)
        + _linear(merged, model_cfg.projector.out_hidden_size, bias=True)
    )

    embedding = lang.vocab_size * lang.hidden_size
    output_layer = 0 if lang.tie_word_embeddings else embedding
    language_model = (
        embedding + lang.num_layers * language_layer_parameters(model_cfg) + lang.hidden_size + output_layer
    )
    return {
        "vision_model": vision_model,
        "projector": projector,
        "language_model": language_model,
        "total": vision_model + projector + language_model,
    }
