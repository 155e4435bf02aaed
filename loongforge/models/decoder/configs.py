"""megatron-core ``TransformerConfig``s every family builds from: the decoder's, and the settings
all towers share (precision, dropout, fusions that need CUDA kernels, recompute).

Families build their tower configs with ``common`` and ``recompute`` so that a precision or fusion
rule is written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from loongforge.config.layout import expert_tensor_parallel_size
from loongforge.config.pipeline_layout import megatron_virtual_stages
from loongforge.config.schema import LanguageConfig, ParallelConfig
from loongforge.models.decoder.layer_costs import head_dim
from loongforge.models.decoder.sliding_attention import SlidingWindowTransformerConfig
from loongforge.models.decoder.sparse_attention import SparseAttentionTransformerConfig

def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # CLIP's GELU approximation (Qwen2-VL's, ERNIE-4.5-VL's ViTs)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "quick_gelu": _quick_gelu}


def activation(name: str, key: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"{key}={name!r} is not one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def recompute(enabled: bool) -> dict:
    # Full recompute of every layer: activation memory drops to one layer's inputs per layer, for
    # about a third more compute; what the 32B/72B presets need to fit long packed rows.
    if not enabled:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def common(params_dtype: torch.dtype, on_cpu: bool) -> dict:
    return dict(
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # CPU tensors cannot be created on torch.cuda.current_device(); megatron then builds the full
        # weight on CPU and keeps this rank's shard, which is also TP-size independent.
        use_cpu_initialization=on_cpu,
        # The families here train without dropout.
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
    lang: LanguageConfig, parallel_cfg: ParallelConfig, params_dtype: torch.dtype, on_cpu: bool,
    recompute_layers: bool = False, rotary_interleaved: bool = False,
) -> TransformerConfig:
    """The decoder: SwiGLU MLP, GQA, RMSNorm, optional qkv bias and per-head q/k norm. Rotary
    positions are the family's choice (``LanguageModel``'s ``position_embedding_type``); M-RoPE
    sections, when the model has them, must cover every rotary pair. ``rotary_interleaved``: each head
    rotates adjacent channel pairs (2j, 2j+1) rather than its two halves (the family's rotary module gives
    the angles in that layout)."""
    channels = head_dim(lang)
    if lang.mrope_section and 2 * sum(lang.mrope_section) != rotary_channels(lang):
        raise ValueError(f"model.language.mrope_section={lang.mrope_section} must sum to the rotary "
                         f"channels / 2 = {rotary_channels(lang) // 2}")
    config_class = MLATransformerConfig if lang.multi_latent_attention else TransformerConfig
    if lang.sliding_window is not None:
        config_class = SlidingWindowTransformerConfig
    if lang.sparse_attention is not None:
        config_class = SparseAttentionTransformerConfig
    return config_class(
        num_layers=lang.num_layers,
        hidden_size=lang.hidden_size,
        ffn_hidden_size=lang.ffn_hidden_size,
        num_attention_heads=lang.num_attention_heads,
        num_query_groups=lang.num_query_groups,
        kv_channels=channels,
        layernorm_epsilon=lang.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: [gate, up] in linear_fc1
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=lang.add_qkv_bias,
        # megatron sums these norms' gradients over TP (each rank normalises its own heads); norms over all
        # heads (``qk_norm_type: per_layer``) hold a shard of their weight each, which it must not sum.
        qk_layernorm=lang.qk_norm and lang.qk_norm_type == "per_head",
        mrope_section=list(lang.mrope_section) or None,
        rotary_interleaved=rotary_interleaved,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron_virtual_stages(parallel_cfg),
        # megatron-core reads the same string (its stages, their layers, the layer offsets).
        pipeline_model_parallel_layout=parallel_cfg.pipeline_layout,
        **interleaved_messages(parallel_cfg),
        sequence_parallel=parallel_cfg.sequence_parallel,
        context_parallel_size=parallel_cfg.context_parallel_size,
        # "auto": megatron's default on te (p2p) and the gathered keys and values on sdpa / flash.
        cp_comm_type=None if parallel_cfg.context_parallel_comm == "auto" else parallel_cfg.context_parallel_comm,
        cross_entropy_loss_fusion=False,
        attention_output_gate=lang.attention_output_gate,
        layernorm_zero_centered_gamma=lang.zero_centered_norms,
        **linear_attention(lang),
        **multi_latent_attention(lang),
        **sparse_attention(lang),
        **sliding_window(lang),
        **experts(lang, parallel_cfg),
        **multi_token_prediction(lang),
        **recompute(recompute_layers),
        **common(params_dtype, on_cpu),
    )


def rotary_channels(lang: LanguageConfig) -> int:
    """Channels of each head that RoPE rotates (the first ones; the rest pass through)."""
    return int(head_dim(lang) * lang.partial_rotary_factor)


def linear_attention(lang: LanguageConfig) -> dict:
    """Gated DeltaNet's shape, and which layers run it (megatron's 1 = linear, 0 = full attention). A
    pattern makes megatron save each layer under its own checkpoint keys (the layers differ in tensors)."""
    if "linear_attention" not in lang.layer_types:
        return {}
    shape = lang.linear_attention
    pattern = [int(kind == "linear_attention") for kind in lang.layer_types]
    facts = dict(linear_attention_freq=pattern)
    if shape is not None:
        facts.update(linear_conv_kernel_dim=shape.conv_kernel, linear_key_head_dim=shape.key_head_dim,
                     linear_value_head_dim=shape.value_head_dim, linear_num_key_heads=shape.num_key_heads,
                     linear_num_value_heads=shape.num_value_heads)
    return facts


def multi_latent_attention(lang: LanguageConfig) -> dict:
    """megatron's MLA settings (``MLATransformerConfig``): the latent ranks, the head widths and the RoPE
    (YaRN's or plain) of the decoupled rotary channels, which megatron takes in DeepSeek's interleaved
    pairs as transformers' ``rope_interleave`` does. None for a GQA decoder."""
    mla = lang.multi_latent_attention
    if mla is None:
        return {}
    facts = dict(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
                 qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, rotary_base=lang.rope_theta,
                 rope_type="rope" if lang.yarn is None else "yarn")
    if lang.yarn is not None:
        facts.update(rotary_scaling_factor=lang.yarn.factor,
                     original_max_position_embeddings=lang.yarn.original_max_position_embeddings,
                     beta_fast=lang.yarn.beta_fast, beta_slow=lang.yarn.beta_slow, mscale=lang.yarn.mscale,
                     mscale_all_dim=lang.yarn.mscale_all_dim)
    else:
        # Plain RoPE: megatron's softmax scale takes mscale(rotary_scaling_factor, mscale_all_dim), which
        # is 1 at mscale_all_dim 0.
        facts.update(mscale_all_dim=0.0)
    return facts


def sparse_attention(lang: LanguageConfig) -> dict:
    """DeepSeek Sparse Attention's indexer (``SparseAttentionTransformerConfig``); None without
    ``model.language.sparse_attention``."""
    sparse = lang.sparse_attention
    if sparse is None:
        return {}
    return dict(index_topk=sparse.index_topk, index_n_heads=sparse.index_n_heads,
                index_head_dim=sparse.index_head_dim, index_rope_interleaved=sparse.rope_interleaved,
                index_stage=sparse.stage, index_loss_coeff=sparse.indexer_loss_coeff)


def sliding_window(lang: LanguageConfig) -> dict:
    """MiMo-V2-Flash's attention (``SlidingWindowTransformerConfig``): which layers slide, the window, the
    sliding layers' key/value heads, sinks and RoPE theta, and what every layer shares (the value width and
    scale, the rotated share of a head, the full layers' theta). None without ``model.language.sliding_window``."""
    window = lang.sliding_window
    if window is None:
        return {}
    return dict(sliding_layer_pattern=[int(kind == "sliding_attention") for kind in lang.layer_types],
                sliding_window_size=window.size, sliding_num_query_groups=window.num_query_groups,
                sliding_rotary_base=window.rope_theta, sliding_attention_sinks=window.sinks,
                full_rotary_base=lang.rope_theta, attention_rotary_percent=lang.partial_rotary_factor,
                attention_v_head_dim=window.v_head_dim, attention_value_scale=window.value_scale,
                # the two kinds differ in tensors: megatron saves each layer under keys of its own
                hetereogenous_dist_checkpoint=True)


def interleaved_messages(parallel_cfg: ParallelConfig) -> dict:
    """How the interleaved schedule exchanges activations: one isend / irecv per message, posted
    early and waited for later (Megatron-LM's setting for virtual stages). Batched, a rank's two
    messages to the same neighbour (an activation forward, a gradient back: at PP 2 both neighbours
    are one rank) are paired with the neighbour's receives by posting order alone, and the
    activation can land in the gradient's buffer; megatron's unbatched path sends the two
    directions on different groups."""
    if megatron_virtual_stages(parallel_cfg) is None:
        return {}
    return {"batch_p2p_comm": False, "overlap_p2p_comm": True}


def experts(lang: LanguageConfig, parallel_cfg: ParallelConfig) -> dict:
    """megatron-core's MoE settings for ``lang`` (none for a dense model).

    Qwen3-MoE's router: softmax over all experts, top-k, renormalised when ``norm_topk_prob``.
    megatron's softmax router without ``moe_router_pre_softmax`` takes the top-k logits and
    softmaxes over those k alone, which is the renormalised top-k of the full softmax
    (exp(l_i) / sum_k exp(l_k) either way); with ``moe_router_pre_softmax`` it softmaxes over all
    experts first and keeps the k probabilities as they are (``norm_topk_prob: false``).
    Experts hold plain linears per expert (megatron's ``SequentialMLP`` layout, whichever module
    ``model.language.moe.experts`` picks to compute them: ``layer_backend.resolve_experts``; megatron's own
    ``moe_grouped_gemm`` stays off, its kernels are Transformer Engine's or grouped_gemm's),
    ``num_experts / expert_model_parallel_size`` of them on each rank; tokens reach them
    through the all-to-all dispatcher (on the CPU its CUDA stream is a stand-in:
    ``parallel.mcore_patches``). No expert bias, no token dropping. A shared expert (Qwen3.5-MoE) is
    megatron's gated ``SharedExpertMLP``: sigmoid(x . gate) times its SwiGLU output, added to the routed.
    """
    moe = lang.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.router_topk,
        moe_router_score_function=moe.router_score_function,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32" if moe.router_fp32 else None,
        moe_router_enable_expert_bias=moe.router_bias_update_rate > 0,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor if moe.routed_scaling_factor != 1.0 else None,
        **moe_layer_pattern(lang),
        # Modality-isolated routers train transformers' loss over all sparse layers instead (``modality_balance``).
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 and not moe.vision_ffn_hidden_size else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size(parallel_cfg),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_ffn_hidden_size is not None and moe.shared_expert_gate,
        moe_shared_expert_overlap=shared_expert_overlap(lang, parallel_cfg),
    )


def shared_expert_overlap(lang: LanguageConfig, parallel_cfg: ParallelConfig) -> bool:
    """Whether the shared expert runs beside the routed tokens' all-to-all (``parallel.moe_shared_expert_overlap``).

    Only where there is an all-to-all to hide it behind (EP > 1) and megatron's overlapped path computes what its
    plain one does: that path runs ``SharedExpertMLP``'s pieces from inside the token dispatcher, so the
    modality-split MoE (``modality_moe``, which calls its shared expert itself) keeps the plain path.
    """
    moe = lang.moe
    return (parallel_cfg.moe_shared_expert_overlap and moe.shared_expert_ffn_hidden_size is not None
            and parallel_cfg.expert_model_parallel_size > 1 and not moe.vision_ffn_hidden_size)


def moe_layer_pattern(lang: LanguageConfig) -> dict:
    """Which layers are sparse (megatron's ``moe_layer_freq``: 1 MoE, 0 the dense MLP), given only where the
    first ``moe.first_dense_layers`` are dense: a pattern makes megatron save each layer under its own
    checkpoint keys (the layers differ in tensors), which a decoder of one kind must not change."""
    dense = lang.moe.first_dense_layers if lang.moe else 0
    if not dense:
        return {}
    return dict(moe_layer_freq=[0] * dense + [1] * (lang.num_layers - dense))


def multi_token_prediction(lang: LanguageConfig) -> dict:
    """megatron's MTP settings: its layers and their loss's scale (divided by the layers there)."""
    if not lang.mtp_num_layers:
        return {}
    return dict(mtp_num_layers=lang.mtp_num_layers, mtp_loss_scaling_factor=lang.mtp_loss_coeff)
