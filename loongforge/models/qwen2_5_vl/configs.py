"""Translate loongforge's typed ``ModelConfig`` into megatron-core ``TransformerConfig``s.

Three configs, one per role: ``language_model`` (the Qwen2 decoder), ``vision_model`` (the ViT
blocks) and ``projector`` (the patch merger MLP). Settings shared by all three (precision, dropout,
fusions that need CUDA kernels) are in ``_common``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config import layout
from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models.hf_rules import padded_vocab_size  # noqa: F401  (model.py sizes its vocabulary with it)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def vision_tensor_parallel_size(parallel_cfg: ParallelConfig) -> int:
    """``parallel.vision_tensor_model_parallel_size`` with ``None`` meaning "same as language".

    Whether the layout fits is the family's layout rule (``config.layout.layout_problems``),
    checked when the config is validated; ``build_vision_tp_group`` still refuses a size it
    cannot cut groups for."""
    return layout.vision_tensor_parallel_size(parallel_cfg)


def _activation(name: str, key: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"{key}={name!r} is not one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _recompute(enabled: bool) -> dict:
    # Full recompute of every layer: activation memory drops to one layer's inputs per layer, for
    # about a third more compute; what the 32B/72B presets need to fit long packed rows.
    if not enabled:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _common(params_dtype: torch.dtype, on_cpu: bool) -> dict:
    return dict(
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # CPU tensors cannot be created on torch.cuda.current_device(); megatron then builds the full
        # weight on CPU and keeps this rank's shard, which is also TP-size independent.
        use_cpu_initialization=on_cpu,
        # Qwen2.5-VL trains without dropout.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fused kernels below exist only as CUDA/TE code paths.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        normalization="RMSNorm",
    )


def language_config(
    model_cfg: ModelConfig, parallel_cfg: ParallelConfig, params_dtype: torch.dtype, on_cpu: bool,
    recompute: bool = False,
) -> TransformerConfig:
    lang = model_cfg.language
    head_dim = lang.hidden_size // lang.num_attention_heads
    if 2 * sum(lang.mrope_section) != head_dim:
        raise ValueError(
            f"model.language.mrope_section={lang.mrope_section} must sum to head_dim/2={head_dim // 2}"
        )
    return TransformerConfig(
        num_layers=lang.num_layers,
        hidden_size=lang.hidden_size,
        ffn_hidden_size=lang.ffn_hidden_size,
        num_attention_heads=lang.num_attention_heads,
        num_query_groups=lang.num_query_groups,
        kv_channels=head_dim,
        layernorm_epsilon=lang.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: [gate, up] in linear_fc1
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=lang.add_qkv_bias,
        mrope_section=list(lang.mrope_section),
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        cross_entropy_loss_fusion=False,
        **_recompute(recompute),
        **_common(params_dtype, on_cpu),
    )


def vision_config(
    model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool,
    recompute: bool = False,
) -> TransformerConfig:
    vis = model_cfg.vision
    return TransformerConfig(
        num_layers=vis.depth,
        hidden_size=vis.hidden_size,
        ffn_hidden_size=vis.intermediate_size,
        num_attention_heads=vis.num_heads,
        num_query_groups=vis.num_heads,
        kv_channels=vis.hidden_size // vis.num_heads,
        layernorm_epsilon=vis.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=_activation(vis.hidden_act, "model.vision.hidden_act"),
        add_bias_linear=True,  # qkv, proj and the MLP all carry biases in the ViT
        # The tower lives whole on the first pipeline stage and never sequence-parallel.
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **_recompute(recompute),
        **_common(params_dtype, on_cpu),
    )


def projector_config(
    model_cfg: ModelConfig, vision_tp: int, params_dtype: torch.dtype, on_cpu: bool
) -> TransformerConfig:
    """The merger MLP as a megatron ``MLP``: input 4*vision hidden -> 4*vision hidden -> out_hidden.

    ``hidden_size`` is the MLP's *output* width (megatron's MLP maps input_size -> ffn -> hidden).
    """
    merged_width = model_cfg.vision.hidden_size * model_cfg.projector.spatial_merge_size**2
    return TransformerConfig(
        num_layers=1,
        hidden_size=model_cfg.projector.out_hidden_size,
        ffn_hidden_size=merged_width,
        # Unused by an MLP, but TransformerConfig checks it divides the TP size; the ViT's does.
        num_attention_heads=model_cfg.vision.num_heads,
        gated_linear_unit=False,
        activation_func=_activation(model_cfg.projector.hidden_act, "model.projector.hidden_act"),
        add_bias_linear=True,
        tensor_model_parallel_size=vision_tp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **_common(params_dtype, on_cpu),
    )
