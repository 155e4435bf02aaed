"""Tiny random transformers text LLMs (Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Llama 3.x, DeepSeek) and their loongforge
configs."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models.decoder.moe_balance import layer_statistics
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.llm.model import build_model
from loongforge.models.registry import get_family

# Each architecture's distinguishing features at toy size: Qwen2's q/k/v biases; Qwen3's q/k norms
# with a head_dim that is not hidden / heads, and tied embeddings; Llama's llama3 RoPE scaling.
ARCHITECTURES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=10_000.0,
                  tie_word_embeddings=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24, rope_theta=1_000_000.0,
                  tie_word_embeddings=True),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500_000.0,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# 300 is not a multiple of 128: the padded vocabulary rows are exercised too.
_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=131072, hidden_act="silu")


def tiny_hf_config_dict(arch: str, **overrides) -> dict:
    return {**_SHAPE, **ARCHITECTURES_WITH_MOE[arch], **overrides}


def tiny_llm_cfg(arch: str) -> ModelConfig:
    """Our config, read from the HF config.json the tiny model is built from (the convert path)."""
    return get_family("llm").config_from_hf(tiny_hf_config_dict(arch), f"{arch}/config.json")


_ZERO_CENTRED_NORMS = ("qwen3_next", "qwen3_5_moe_text")


def build_hf_llm(arch: str, seed: int = 0, **overrides):
    """A random fp32 transformers causal LM (``overrides``: config.json fields); every parameter (norms too)
    randomised, norms around their identity scale (a zero-centred norm's weight around 0: it scales by 1 + weight;
    Qwen3-Next's gated norm scales by its weight)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_hf_config_dict(arch, **overrides)
    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        zero_centred = config["model_type"] in _ZERO_CENTRED_NORMS
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            centre = 0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0
            # attention sinks (MiMo-V2-Flash's) as logits of the scores' size, so each head's moves its softmax
            param.copy_(centre + 0.1 * noise if "norm" in name else noise if name.endswith(".sinks") else 0.05 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert bias: trained state too
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model


def build_pair(arch: str):
    """(ModelConfig, transformers model, our megatron model holding its weights), fp32 on CPU; needs
    megatron's parallel state (the ``megatron_world_of_one`` fixture)."""
    model_cfg = tiny_llm_cfg(arch)
    hf_model = build_hf_llm(arch)
    model = build_model(model_cfg, ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu").eval()
    load_hf_state_dict(model, hf_model.state_dict())
    return model_cfg, hf_model, model


def text_positions(length: int) -> torch.Tensor:
    """[3, 1, L]: the data pipeline's positions of one text sample."""
    return torch.arange(length).expand(3, 1, length)


# Qwen3-MoE at toy size: Qwen3's attention (q/k norms, head_dim 24), every layer 4 routed experts of
# width 32 with top-2 routing. ``norm_topk_prob`` false is the other router (no renormalisation).
MOE_ARCHITECTURES = {
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=24,
                      rope_theta=1_000_000.0, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
MOE_ARCHITECTURES["qwen3_moe_unnormalised"] = {**MOE_ARCHITECTURES["qwen3_moe"], "norm_topk_prob": False}
# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) at toy size: Qwen2's attention (q/k/v biases) with 3 query heads per KV
# group, 6 routed experts of width 24, top-3 softmax routing not renormalised (the published configs'), and a
# shared expert of width 40 whose output a sigmoid gate scales per token.
MOE_ARCHITECTURES["qwen2_moe"] = dict(
    architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_attention_heads=6, num_key_value_heads=2,
    hidden_size=48, rope_theta=1_000_000.0, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
    moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=False, router_aux_loss_coef=0.001,
    decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
# Qwen3-Next at toy size: Qwen3.5's hybrid layers (a Gated DeltaNet layer, then a gated full-attention one, twice:
# PP 2 puts one of each on each stage) with 2 key heads of 8 channels serving 4 value heads of 12, gated attention
# of 6 heads of 16 over 2 KV groups with RoPE on its first 4 channels, zero-centred norms; every layer 6 routed
# experts of width 24, top-3 renormalised (the published router), beside a gated shared expert of width 40.
MOE_ARCHITECTURES["qwen3_next"] = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=4, hidden_size=48,
    num_attention_heads=6, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
    moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=True, router_aux_loss_coef=0.001,
    decoder_sparse_step=1, mlp_only_layers=[])
# Qwen3.5-MoE's decoder read as a text model (Qwen3_5MoeForCausalLM: Qwen3.8-2.4T-A95B's class): qwen3_next's shape,
# Gated DeltaNet's input projection in Qwen3.5's four tensors, the router always renormalising, tied embeddings.
MOE_ARCHITECTURES["qwen3_5_moe_text"] = {
    **MOE_ARCHITECTURES["qwen3_next"], "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "tie_word_embeddings": True}
# DeepSeek at toy size: multi-latent attention (V3: low-rank queries; V2-Lite's full-rank ones) with YaRN,
# the first layer dense, shared experts beside the routed ones. V3: sigmoid router with the expert bias,
# 8 experts in 4 groups, top-4 within the best 2 groups, scaling 2.5; V2: softmax greedy top-2 of 6, scaling 1.5.
_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, moe_intermediate_size=32, first_k_dense_replace=1, max_position_embeddings=256,
            rope_interleave=True, attention_bias=False, tie_word_embeddings=False)
DEEPSEEK_ARCHITECTURES = {
    "deepseek_v3": dict(_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=24,
                        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "rope_theta": 10_000.0}),
    "deepseek_v2": dict(_MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                        rms_norm_eps=1e-5,  # Moonlight's; the latent norms keep 1e-6 in transformers
                        n_routed_experts=6, n_group=1, topk_group=1, topk_method="greedy", num_experts_per_tok=2,
                        n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                      "rope_theta": 10_000.0}),
    # V3.2: V3's model with DeepSeek Sparse Attention, each query attending to its 8 best-scoring earlier tokens
    # (fewer than the test prompts', so the indexer decides the output) by an indexer of 4 heads of 16 channels
    # (few heads: keys no head scores above zero tie at 0, so the top-k cut meets ties); YaRN's mscale apart from
    # mscale_all_dim, so its cos/sin factor reaches the indexer's RoPE too.
    "deepseek_v32": dict(_MLA, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", q_lora_rank=24,
                         n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8, index_n_heads=4,
                         index_head_dim=16,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                                       "rope_theta": 10_000.0}),
}
# GLM-5 at toy size: V3.2's model whose indexer rotates interleaved pairs; no expert groups (n_group 1), top-2 of 8,
# plain RoPE, rms_norm_eps 1e-5 (its latent norms keep 1e-6).
GLM_ARCHITECTURES = {
    "glm_moe_dsa": dict(_MLA, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", q_lora_rank=24,
                        n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8, index_n_heads=4,
                        index_head_dim=16, rms_norm_eps=1e-5, rope_theta=10_000.0),
}
# MiniMax-M2 at toy size: 6 query heads over 2 KV groups of width 16 (q is 96 wide beside a 64-wide hidden state), q/k
# norms over all heads, RoPE on 8 of each head's 16 channels; 6 experts of width 32 in every layer, top-3 by sigmoid
# scores plus the expert bias, the unbiased scores renormalised.
MOE_ARCHITECTURES["minimax_m2"] = dict(
    architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", num_attention_heads=6, num_key_value_heads=2,
    head_dim=16, rotary_dim=8, intermediate_size=32, num_local_experts=6, num_experts_per_tok=3, rope_theta=5_000_000.0,
    tie_word_embeddings=False, router_aux_loss_coef=0.0, scoring_func="sigmoid", use_routing_bias=True,
    use_qk_norm=True, qk_norm_type="per_layer", shared_intermediate_size=0, attn_type_list=[1, 1], bos_token_id=1,
    eos_token_id=2)
# MiMo-V2-Flash at toy size: 12 query heads over 2 key/value heads in the full layers and 4 (twice, as published) in
# the sliding ones, each with a sink logit per head and a window of 5 tokens (shorter than the packed samples); q/k
# head_dim 24, values 16 wide and scaled by 0.707, a third of each head rotated, each kind under its own RoPE theta;
# the first layer dense, then 6 routed experts in 3 groups, top-4 within the best 2 groups by the sigmoid router
# with the expert bias, scaled by 1.5. Over PP 2 each stage holds a layer of each kind.
MIMO_ARCHITECTURES = {
    "mimo_v2_flash": dict(
        architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", num_hidden_layers=4, hidden_size=48,
        num_attention_heads=12, num_key_value_heads=2, head_dim=24, v_head_dim=16, attention_value_scale=0.707,
        sliding_window=5, tie_word_embeddings=False, attention_bias=False, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rms_norm_eps=1e-5,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                            "partial_rotary_factor": 0.334},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0,
                                               "partial_rotary_factor": 0.334}},
        n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=4, moe_intermediate_size=32,
        routed_scaling_factor=1.5, norm_topk_prob=True),
}
ARCHITECTURES_WITH_MOE = {**ARCHITECTURES, **MOE_ARCHITECTURES, **DEEPSEEK_ARCHITECTURES, **GLM_ARCHITECTURES,
                          **MIMO_ARCHITECTURES}


def answer_masked_row(length: int, loss_tokens: int, seed: int, packed: bool = True, padding: int = 0) -> dict:
    """A micro-batch of one row as ``data.collate`` makes it: two packed samples of ``length`` tokens
    in all (one when not ``packed``), the loss on the last ``loss_tokens`` of them (an answer), then
    ``padding`` pad tokens."""
    generator = torch.Generator().manual_seed(seed)
    split = length // 2 if packed else length
    total = length + padding
    input_ids = torch.randint(0, 300, (1, total), generator=generator)
    loss_mask = torch.zeros(1, total)
    loss_mask[0, length - loss_tokens:length] = 1.0
    positions = torch.cat([torch.arange(split), torch.arange(length - split), torch.arange(padding)])
    return {"input_ids": input_ids, "labels": torch.roll(input_ids, -1, dims=1), "loss_mask": loss_mask,
            "padding_mask": (torch.arange(total) >= length)[None],
            "position_ids": positions.expand(3, 1, total).contiguous(),
            "cu_seqlens": torch.tensor(sorted({0, split, length, total}), dtype=torch.int32),
            "num_loss_tokens": loss_tokens}


def expected_balance_grad(weight: torch.Tensor, inputs: list, topk: int, coefficient: float) -> torch.Tensor:
    """coeff * d/dW of the mean of the micro-batches' balance losses, each over its router inputs
    [T, 1, h] (real tokens only); the last layer's alone, as nothing before its router depends on its
    weight."""
    weight = weight.detach().clone().requires_grad_(True)
    objective = 0.0
    for hidden in inputs:
        logits = hidden.reshape(-1, weight.shape[1]).float() @ weight.t()  # [T, E]
        fractions, _ = layer_statistics(logits.detach(), topk)
        probs = torch.softmax(logits, dim=-1).mean(dim=0)  # [E]
        objective = objective + weight.shape[0] / topk * torch.sum(fractions * probs) / len(inputs)
    (coefficient * objective).backward()
    return weight.grad


def router_grad(chunks, router, micro_batches: list[dict], coefficient: float,
                is_loss_rank: bool = True) -> tuple[torch.Tensor, list]:
    """``router``'s weight gradient after loongforge's step (forward, backward, finalize) at the
    balance-loss ``coefficient``, and the router's inputs per micro-batch; ``chunks``: the model as
    ``train.runner.wrap_for_training`` wraps it."""
    from loongforge.train.step import forward_backward

    config = router.config
    config.moe_aux_loss_coeff = coefficient
    inputs = []
    handle = router.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    chunks[0].zero_grad_buffer()
    try:
        forward_backward(chunks, micro_batches, device=torch.device("cpu"), seq_length=64,
                         is_loss_rank=is_loss_rank)
    finally:
        handle.remove()
    return router.weight.main_grad.clone(), inputs
