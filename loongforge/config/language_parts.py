"""The decoder's layer kinds as config sections, each with its own checks.

``model.language`` is a stack of decoder layers; what a layer mixes tokens with and what its MLP is
are kinds, each a section of its own that is null when the run does not build it:

- attention: grouped-query attention (the language fields themselves), ``multi_latent_attention``
  (DeepSeek's MLA) in its place, ``linear_attention`` (Gated DeltaNet) for the layers
  ``layer_types`` names so; ``sliding_window`` (MiMo-V2-Flash's attention: sliding-window layers with
  learned sink logits among full ones, values narrower than queries and keys); ``sparse_attention``
  (DeepSeek Sparse Attention: a lightning indexer picks each query's top-k keys, multi-latent attention
  attends to those alone);
- MLP: the dense SwiGLU of ``ffn_hidden_size``, or ``moe`` (routed experts, a shared expert).

A section checks itself (``problems``: one line per problem naming its key and the fix); the
parameter, FLOP and activation counts of each kind are ``models.decoder.layer_costs``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loongforge.config.moved_keys import move_into_section

LANGUAGE_KEY = "model.language"
EXPERT_KINDS = ("auto", "grouped", "sequential")  # model.language.moe.experts
LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")
SPARSE_ATTENTION_STAGES = ("dense_warmup", "sparse")  # model.language.sparse_attention.stage


def _divisors_of(number: int) -> str:
    """The sizes a parallel dimension may take to split ``number`` heads or channels evenly."""
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet's linear attention (Qwen3.5's ``linear_attention`` layers): per key head a recurrent
    state [key_head_dim, value_head_dim] instead of a KV cache, after a short causal convolution."""

    KEY = f"{LANGUAGE_KEY}.linear_attention"

    num_key_heads: int = 16
    num_value_heads: int = 32  # a multiple of num_key_heads: each key head serves that many value heads
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4  # taps of the depthwise causal convolution over q, k, v

    def problems(self, *, tensor_parallel: int) -> list[str]:
        if min(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel) < 1:
            return [f"{self.KEY}={self}: every size must be at least 1."]
        errors = []
        if self.num_value_heads % self.num_key_heads:
            errors.append(f"{self.KEY}.num_value_heads={self.num_value_heads} is not a multiple of "
                          f"num_key_heads={self.num_key_heads} (each key head serves whole value heads).")
        elif self.num_key_heads % tensor_parallel:
            errors.append(f"parallel.tensor_model_parallel_size={tensor_parallel} does not divide {self.KEY}."
                          f"num_key_heads={self.num_key_heads} (TP splits the linear layers by key head); use one "
                          f"of {_divisors_of(self.num_key_heads)}.")
        return errors


@dataclass
class YarnConfig:
    """YaRN's RoPE extension (DeepSeek-V2/V3, Kimi K2): the rotary frequencies interpolated between
    ``beta_slow`` and ``beta_fast`` rotations over the original context, cos/sin scaled by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax by mscale(factor,
    mscale_all_dim)^2, where mscale(s, m) = 0.1 m ln(s) + 1 (transformers' ``rope_type: yarn``)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


def _unproven_context_parallel(context_parallel: int, what: str) -> list[str]:
    """The one-line refusal of CP > 1 for a part whose context-parallel run is not proven yet; [] at CP 1."""
    if context_parallel <= 1:
        return []
    return [f"parallel.context_parallel_size={context_parallel}: context parallelism with {what} is not proven "
            f"against one process yet; use 1."]


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight): every head's keys and values come up
    from one shared latent of ``kv_lora_rank`` channels per token; each head's query and key are
    ``qk_nope_head_dim`` channels without position plus ``qk_rope_head_dim`` rotated ones, the key's
    rotated part one per token shared by all heads (its own slice of the latent projection)."""

    KEY = f"{LANGUAGE_KEY}.multi_latent_attention"

    # Queries through a low-rank latent of this width (with an RMSNorm); null: one full-rank projection
    # (DeepSeek-V2-Lite).
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def problems(self, *, num_attention_heads: int, num_query_groups: int, tensor_parallel: int,
                 context_parallel: int) -> list[str]:
        errors = []
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
               self.q_lora_rank or 1) < 1:
            errors.append(f"{self.KEY}={self}: every rank and width must be at least 1.")
        if self.qk_rope_head_dim % 2:
            errors.append(f"{self.KEY}.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs).")
        if num_attention_heads % tensor_parallel:
            errors.append(f"parallel.tensor_model_parallel_size={tensor_parallel} does not divide {LANGUAGE_KEY}."
                          f"num_attention_heads={num_attention_heads}; use one of "
                          f"{_divisors_of(num_attention_heads)}.")
        latents = {"kv_lora_rank + qk_rope_head_dim": self.kv_lora_rank + self.qk_rope_head_dim,
                   "q_lora_rank": self.q_lora_rank or 0}
        errors += [f"parallel.tensor_model_parallel_size={tensor_parallel} does not divide {self.KEY}'s {name} = "
                   f"{width} (TP splits the latent projections' rows, then gathers them)."
                   for name, width in latents.items() if width % tensor_parallel]
        if num_query_groups != num_attention_heads:
            errors.append(f"{LANGUAGE_KEY}.num_query_groups={num_query_groups} must equal num_attention_heads="
                          f"{num_attention_heads} with multi_latent_attention (a key and value per head).")
        return errors + _unproven_context_parallel(context_parallel, "multi-latent attention")


@dataclass
class MoEConfig:
    """Routed experts in place of the dense MLP (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE, DeepSeek-V2/V3),
    run by megatron-core's MoE layer: a router scores the experts per token, the token runs through the
    top ``router_topk`` and, if any, a shared expert beside them."""

    KEY = f"{LANGUAGE_KEY}.moe"

    # Routed experts per sparse layer.
    num_experts: int = 8
    # Channels of each expert's SwiGLU MLP (transformers' moe_intermediate_size); a run sets it.
    ffn_hidden_size: Optional[int] = None
    # Experts each token is routed to (transformers' num_experts_per_tok).
    router_topk: int = 2
    # Renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE: true).
    norm_topk_prob: bool = True
    # Weight of the load-balancing loss (transformers' router_aux_loss_coef); 0: none.
    aux_loss_coeff: float = 0.0
    # A shared expert beside the routed ones: a SwiGLU MLP of this width every token runs through; null: none.
    shared_expert_ffn_hidden_size: Optional[int] = None
    # The shared expert's output scaled by sigmoid of a learned gate per token (Qwen3.5-MoE); false: added
    # as it is (DeepSeek's shared experts).
    shared_expert_gate: bool = True
    # The first layers keep the dense SwiGLU MLP of model.language.ffn_hidden_size (DeepSeek's
    # first_k_dense_replace); the rest are sparse.
    first_dense_layers: int = 0
    # The router's scores: "softmax" over the experts (Qwen3-MoE, DeepSeek-V2) or a "sigmoid" per expert,
    # the top-k renormalised (DeepSeek-V3).
    router_score_function: str = "softmax"
    # The router's logits in fp32 whatever the training precision (DeepSeek's routers are).
    router_fp32: bool = False
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores when choosing
    # experts (never to the weights), moved after every step by this rate toward the layer's mean load
    # (each expert's bias +rate below the mean, -rate above); 0: no bias.
    router_bias_update_rate: float = 0.0
    # Group-limited routing: the experts in this many equal groups, each token choosing among the
    # router_group_topk groups with the largest sums of their top (topk / group_topk) scores; null: none.
    router_num_groups: Optional[int] = None
    router_group_topk: Optional[int] = None
    # The routing weights times this factor (DeepSeek's routed_scaling_factor).
    routed_scaling_factor: float = 1.0
    # Modality-isolated experts (ERNIE-4.5-VL): a second set of num_experts experts, each this wide, that the
    # image and video tokens (and their markers) are routed to, by a router of their own; the text tokens keep
    # the ffn_hidden_size experts. Each set's router chooses by softmax plus a fixed per-expert bias (carried
    # in checkpoints, not trained) and weighs by the renormalised softmax. null: one set for every token.
    vision_ffn_hidden_size: Optional[int] = None
    # How the routed experts compute (checkpoints are the same either way): "grouped", one grouped GEMM per
    # projection (torch._grouped_mm on CUDA, bf16); "sequential", megatron's SequentialMLP, one MLP call per
    # expert; "auto", grouped on CUDA at bf16, else sequential (the CPU's reference; docs/benchmarks/moe.md).
    experts: str = "auto"

    @property
    def loss_per_row(self) -> bool:
        """The training objective holds a statistic of each micro-batch's rows (the load-balancing loss is
        computed over a micro-batch's tokens), so which samples share a row is part of the math."""
        return self.aux_loss_coeff > 0

    def problems(self, *, num_layers: int) -> list[str]:
        key = self.KEY
        if self.num_experts < 1:
            return [f"{key}.num_experts={self.num_experts} must be at least 1 (a dense model sets {key}: null)."]
        errors = []
        if self.experts not in EXPERT_KINDS:
            errors.append(f"{key}.experts={self.experts!r} must be one of {', '.join(EXPERT_KINDS)}.")
        if self.ffn_hidden_size is None or self.ffn_hidden_size < 1:
            errors.append(f"{key}.ffn_hidden_size={self.ffn_hidden_size} must be at least 1 (each expert's MLP width).")
        shared = self.shared_expert_ffn_hidden_size
        if shared is not None and shared < 1:
            errors.append(f"{key}.shared_expert_ffn_hidden_size={shared} must be at least 1 (null: no shared expert).")
        if not 1 <= self.router_topk <= self.num_experts:
            errors.append(f"{key}.router_topk={self.router_topk} must be between 1 and {key}.num_experts="
                          f"{self.num_experts}.")
        if self.aux_loss_coeff < 0:
            errors.append(f"{key}.aux_loss_coeff={self.aux_loss_coeff} must not be negative (0: none).")
        if not 0 <= self.first_dense_layers < num_layers:
            errors.append(f"{key}.first_dense_layers={self.first_dense_layers} must lie in 0..{num_layers - 1} "
                          f"(model.language.num_layers - 1: the layers after it are sparse).")
        return errors + self._router_problems() + self._modality_problems()

    def _modality_problems(self) -> list[str]:
        key, width = self.KEY, self.vision_ffn_hidden_size
        if width is None:
            return []
        if width < 1:
            return [f"{key}.vision_ffn_hidden_size={width} must be at least 1 (null: one expert set for every token)."]
        fixed = {"router_score_function": (self.router_score_function, "softmax"),
                 "norm_topk_prob": (self.norm_topk_prob, True), "router_bias_update_rate": (self.router_bias_update_rate, 0.0),
                 "router_num_groups": (self.router_num_groups, None), "routed_scaling_factor": (self.routed_scaling_factor, 1.0),
                 "shared_expert_gate": (self.shared_expert_gate, False)}
        errors = [f"{key}.{name}={value!r} with vision_ffn_hidden_size (modality-isolated experts): their routers take the "
                  f"renormalised softmax and the shared expert is ungated; set {name}: {wanted!r}."
                  for name, (value, wanted) in fixed.items() if value != wanted]
        return errors

    def _router_problems(self) -> list[str]:
        key, errors = self.KEY, []
        if self.router_score_function not in ("softmax", "sigmoid"):
            errors.append(f"{key}.router_score_function={self.router_score_function!r} must be softmax or sigmoid.")
        if self.router_score_function == "sigmoid" and not self.norm_topk_prob and self.router_topk > 1:
            errors.append(f"{key}.norm_topk_prob=false with the sigmoid router: megatron-core renormalises the top-k "
                          f"sigmoid scores; set norm_topk_prob: true.")
        if self.router_bias_update_rate < 0:
            errors.append(f"{key}.router_bias_update_rate={self.router_bias_update_rate} must not be negative.")
        if self.router_bias_update_rate > 0 and self.router_score_function != "sigmoid":
            errors.append(f"{key}.router_bias_update_rate needs router_score_function: sigmoid (megatron-core's "
                          f"expert bias).")
        return errors + self._group_problems()

    def _group_problems(self) -> list[str]:
        key, groups, group_topk = self.KEY, self.router_num_groups, self.router_group_topk
        if (groups is None) != (group_topk is None):
            return [f"{key}.router_num_groups={groups} and router_group_topk={group_topk}: set both or neither."]
        if groups is None:
            return []
        if groups < 1 or self.num_experts % groups or not 1 <= group_topk <= groups:
            return [f"{key}.router_num_groups={groups} must divide num_experts={self.num_experts} and "
                    f"router_group_topk={group_topk} lie in 1..{groups}."]
        if self.router_topk % group_topk or self.router_topk // group_topk > self.num_experts // groups:
            return [f"{key}.router_topk={self.router_topk} must be a multiple of router_group_topk={group_topk} and "
                    f"take at most a group's {self.num_experts // groups} experts from each group (groups rank by "
                    f"the sum of their top topk/group_topk scores)."]
        return []


@dataclass
class SlidingWindowConfig:
    """MiMo-V2-Flash's attention (transformers' ``MiMoV2FlashAttention``), in every layer: queries and keys of
    ``model.language.head_dim`` channels, values of ``v_head_dim``, the values times ``value_scale``, the first
    ``partial_rotary_factor`` of each head rotated. ``model.language.layer_types`` says which layers are
    ``sliding_attention``: each query sees itself and the ``size - 1`` tokens before it in its own sample,
    through ``num_query_groups`` key/value heads, under RoPE of ``rope_theta``, and (``sinks``) a learned
    logit per head joins each softmax's denominator without a value. The ``full_attention`` layers see
    every earlier token of their sample through ``model.language.num_query_groups`` heads under
    ``model.language.rope_theta``, without sinks."""

    KEY = f"{LANGUAGE_KEY}.sliding_window"

    # Tokens a sliding layer's query sees, itself included (transformers' sliding_window; the Hub's
    # config.json states sliding_window_size, one less).
    size: int = 129
    # Key/value heads of the sliding layers (MiMo-V2-Flash: twice the full layers').
    num_query_groups: int = 8
    rope_theta: float = 10_000.0
    # A learned logit per query head in every sliding layer's softmax (attention sinks).
    sinks: bool = True
    # Channels of each value head (queries and keys have model.language.head_dim).
    v_head_dim: int = 128
    # Every layer's values times this (transformers' attention_value_scale).
    value_scale: float = 1.0

    def problems(self, *, num_attention_heads: int, num_query_groups: int, tensor_parallel: int,
                 context_parallel: int, layer_types: list) -> list[str]:
        key, errors = self.KEY, []
        if min(self.size, self.num_query_groups, self.v_head_dim) < 1:
            errors.append(f"{key}={self}: size, num_query_groups and v_head_dim must be at least 1.")
            return errors
        if "sliding_attention" not in layer_types:
            errors.append(f"{key} is set but no entry of {LANGUAGE_KEY}.layer_types is sliding_attention; name the "
                          f"sliding layers or set it to null.")
        for name, groups in ((f"{key}.num_query_groups", self.num_query_groups),
                             (f"{LANGUAGE_KEY}.num_query_groups", num_query_groups)):
            if num_attention_heads % groups:
                errors.append(f"{name}={groups} does not divide {LANGUAGE_KEY}.num_attention_heads="
                              f"{num_attention_heads} (each key/value head serves whole query heads).")
            elif groups % tensor_parallel:
                errors.append(f"parallel.tensor_model_parallel_size={tensor_parallel} does not divide {name}="
                              f"{groups} (TP splits whole key/value groups); use one of {_divisors_of(groups)}.")
        return errors + _unproven_context_parallel(context_parallel, key)


@dataclass
class SparseAttentionConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2's DSA; GLM-5's), on multi-latent attention with a query latent: in every
    layer a lightning indexer of ``index_n_heads`` heads of ``index_head_dim`` channels scores each earlier
    token of the query's sample (ReLU of q.k, weighted per head, summed over the heads), and the query attends
    to its ``index_topk`` best-scoring tokens only (all of them while it has no more). The math, and where it
    differs from the published kernels: ``models.decoder.sparse_attention``."""

    KEY = f"{LANGUAGE_KEY}.sparse_attention"

    # Tokens each query attends to (transformers' index_topk).
    index_topk: int = 2048
    index_n_heads: int = 64
    # Channels of each indexer head; its first multi_latent_attention.qk_rope_head_dim are rotated.
    index_head_dim: int = 128
    # The indexer rotates its channels in interleaved pairs (GLM-5); false: channel i with i + half (DeepSeek-V3.2,
    # whose multi-latent attention rotates pairs all the same).
    rope_interleaved: bool = False
    # The training stage (DeepSeek-V3.2's two): "dense_warmup" freezes every parameter but the indexers', attends
    # to every earlier key and trains the indexer toward the main attention; "sparse" (the published models') trains
    # everything on the top-k, the indexer by its loss alone. models.decoder.sparse_attention; docs/stages.md.
    stage: str = "sparse"
    # Weight of the indexer's KL loss (each layer's, summed over layers) in the objective, beside the LM loss's
    # mean over tokens; 0 leaves the indexer untrained (and dense_warmup is then refused: nothing would learn).
    indexer_loss_coeff: float = 1.0

    def problems(self, *, multi_latent_attention: Optional[MLAConfig], context_parallel: int,
                 lora_rank: int = 0) -> list[str]:
        key = self.KEY
        if min(self.index_topk, self.index_n_heads, self.index_head_dim) < 1:
            return [f"{key}={self}: index_topk, index_n_heads and index_head_dim must be at least 1."]
        if self.stage not in SPARSE_ATTENTION_STAGES:
            return [f"{key}.stage={self.stage!r} must be one of {', '.join(SPARSE_ATTENTION_STAGES)}."]
        if not self.indexer_loss_coeff >= 0:
            return [f"{key}.indexer_loss_coeff={self.indexer_loss_coeff} must not be negative."]
        if self.stage == "dense_warmup" and (self.indexer_loss_coeff == 0 or lora_rank):
            why = ("indexer_loss_coeff=0 gives the indexer no loss" if self.indexer_loss_coeff == 0
                   else f"lora.rank={lora_rank} freezes every base weight, the indexers' included")
            return [f"{key}.stage=dense_warmup trains the indexers alone, but {why}: nothing would learn; "
                    f"raise indexer_loss_coeff / set lora.rank=0, or use stage=sparse."]
        if multi_latent_attention is None or multi_latent_attention.q_lora_rank is None:
            return [f"{key} is set but {MLAConfig.KEY}.q_lora_rank is not: the indexer's queries come up from the "
                    f"query latent; give multi_latent_attention with a q_lora_rank, or set {key}: null."]
        errors = []
        rotary = multi_latent_attention.qk_rope_head_dim
        if self.index_head_dim < rotary:
            errors.append(f"{key}.index_head_dim={self.index_head_dim} is below {MLAConfig.KEY}.qk_rope_head_dim="
                          f"{rotary} (the indexer rotates that many of each head's channels); raise it.")
        return errors + _unproven_context_parallel(context_parallel, key)


# Keys of model.language that moved into its moe section: old flat name -> name in the section.
MOVED_TO_MOE = {
    "num_experts": "num_experts", "moe_ffn_hidden_size": "ffn_hidden_size", "moe_router_topk": "router_topk",
    "norm_topk_prob": "norm_topk_prob", "moe_aux_loss_coeff": "aux_loss_coeff",
    "moe_shared_expert_ffn_hidden_size": "shared_expert_ffn_hidden_size",
    "moe_shared_expert_gate": "shared_expert_gate", "first_dense_layers": "first_dense_layers",
    "moe_router_score_function": "router_score_function", "moe_router_fp32": "router_fp32",
    "moe_router_bias_update_rate": "router_bias_update_rate", "moe_router_num_groups": "router_num_groups",
    "moe_router_group_topk": "router_group_topk", "moe_routed_scaling_factor": "routed_scaling_factor",
}


def move_flat_expert_keys(language: dict) -> list[str]:
    """A ``model.language`` tree with the expert keys written flat, as before the ``moe`` section (a saved
    config.yaml, an old override), changed in place to the section; one line per moved key, for the reader.
    ``num_experts: 0`` was a dense model: the section is null and the other flat keys (at their defaults in a
    saved config) go with it, in one line."""
    if "num_experts" in language and not language["num_experts"]:
        others = [language.pop(key) for key in MOVED_TO_MOE if key in language]
        language["moe"] = None
        return [f"{LANGUAGE_KEY}.num_experts=0 (with {len(others) - 1} other flat expert keys) is now "
                f"{MoEConfig.KEY}: null (a dense model); read so."]
    return move_into_section(language, LANGUAGE_KEY, MOVED_TO_MOE, "moe", built=lambda flat: True)


QK_NORM_TYPES = ("per_head", "per_layer")


def qk_norm_problems(*, qk_norm: bool, qk_norm_type: str, num_query_groups: int, tensor_parallel: int) -> list[str]:
    """``model.language.qk_norm_type``: what the q/k norms span. "per_layer" (MiniMax-M2) normalises all heads of q
    (and of k) together: under TP each rank holds whole key heads and the mean square is summed over the group."""
    key = f"{LANGUAGE_KEY}.qk_norm_type"
    if qk_norm_type not in QK_NORM_TYPES:
        return [f"{key}={qk_norm_type!r} must be one of {', '.join(QK_NORM_TYPES)}."]
    if qk_norm_type == "per_head":
        return []
    if not qk_norm:
        return [f"{key}=per_layer needs {LANGUAGE_KEY}.qk_norm: true (it says what the q/k norms span)."]
    if num_query_groups % tensor_parallel:
        return [f"parallel.tensor_model_parallel_size={tensor_parallel} does not divide {LANGUAGE_KEY}."
                f"num_query_groups={num_query_groups} with {key}=per_layer (the key norm spans the key heads, each on "
                f"one rank); use one of {_divisors_of(num_query_groups)}."]
    return []
