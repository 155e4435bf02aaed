"""What each kind of decoder layer costs, in one place per kind: its parameters, its forward FLOPs and the
values it saves for the backward per token. A decoder layer is a token mixer and an MLP:

- token mixers: GQA attention (``GroupedQueryAttention``: q, k, v, o, optional biases, per-head q/k norms and
  output gate), multi-latent attention (``LatentAttention``, DeepSeek's; ``SparseLatentAttention`` with
  DeepSeek-V3.2's indexer) and Gated DeltaNet's linear attention
  (``GatedDeltaNet``, Qwen3.5's);
- MLPs: the dense SwiGLU (``DenseMLP``), the mixture of experts (``Experts``: the router, the routed experts
  and a shared expert) and modality-isolated experts (``ModalityExperts``: a text set and a vision set, each
  with its router, beside ungated shared experts; ERNIE-4.5-VL's).

The plans read them through ``token_mixer`` / ``mlp``: parameter counts (``decoder.params``), model FLOPs
(``models.flops``) and the dry run's activation estimate (``train.dry_run``). A new layer kind is one class
here with its three numbers, proven against transformers by the concern tests (``tests/models/test_counts.py``
counts every preset; ``test_flops.py`` counts FLOPs under torch's counter; ``test_hybrid_counts.py``).
Torch-free: plans count without building a model.
"""

from __future__ import annotations

from typing import Sequence

from loongforge.config.schema import LAYER_TYPES, LanguageConfig, LinearAttentionConfig

FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION = LAYER_TYPES  # model.language.layer_types
# Tokens per chunk of the chunked gated delta rule (fla's ``chunk_gated_delta_rule``, and
# ``models.decoder.linear_attention.chunked``'s default): how far the within-chunk products reach.
DELTA_RULE_CHUNK = 64


def head_dim(lang: LanguageConfig) -> int:
    """Channels per attention head: ``model.language.head_dim``, else hidden / heads."""
    return lang.head_dim or lang.hidden_size // lang.num_attention_heads


def linear_parameters(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def linear_flops(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


def attention_flops(segment_lengths: Sequence[int], q_width: int) -> int:
    """QK^T and AV over each segment's full ``L x L`` square (causal too): ``2 L^2 q_width`` each."""
    return sum(4 * length * length * q_width for length in segment_lengths)


# ---------------------------------------------------------------------------------------------
# Token mixers
# ---------------------------------------------------------------------------------------------


class GroupedQueryAttention:
    """GQA attention: q, k, v (optional biases), o (no bias), optional per-head q/k RMSNorms; with
    ``attention_output_gate`` q_proj also yields each head's gate (Qwen3.5): q_proj [2 heads head_dim, h]."""

    @staticmethod
    def widths(lang: LanguageConfig) -> tuple[int, int, int]:
        """(q width, k or v width, q_proj's output width)."""
        channels = head_dim(lang)
        q_width, kv_width = lang.num_attention_heads * channels, lang.num_query_groups * channels
        return q_width, kv_width, 2 * q_width if lang.attention_output_gate else q_width

    @classmethod
    def parameters(cls, lang: LanguageConfig) -> int:
        h = lang.hidden_size
        q_width, kv_width, q_proj_width = cls.widths(lang)
        q_and_kv = (linear_parameters(h, q_proj_width, lang.add_qkv_bias)
                    + 2 * linear_parameters(h, kv_width, lang.add_qkv_bias))
        qk_norms = 2 * head_dim(lang) if lang.qk_norm else 0
        if lang.qk_norm and lang.qk_norm_type == "per_layer":  # a weight per channel of q and of k
            qk_norms = (lang.num_attention_heads + lang.num_query_groups) * head_dim(lang)
        return q_and_kv + linear_parameters(q_width, h, bias=False) + qk_norms

    @classmethod
    def forward_flops(cls, lang: LanguageConfig, segment_lengths: Sequence[int]) -> int:
        """QKV at the real widths (Qwen3's head_dim need not be hidden / heads), the output projection
        ``q_width -> h``, and attention within each segment."""
        tokens, h = sum(segment_lengths), lang.hidden_size
        q_width, kv_width, q_proj_width = cls.widths(lang)
        projections = linear_flops(tokens, h, q_proj_width + 2 * kv_width) + linear_flops(tokens, q_width, h)
        return projections + attention_flops(segment_lengths, q_width)

    @classmethod
    def saved_values_per_token(cls, lang: LanguageConfig, tp: int, cp: int = 1) -> float:
        """q, k, v and the attention output; with the output gate also the gate and the gated output (the
        output projection's input); under CP the keys and values each local chunk sees (``context_keys``);
        split over TP."""
        q_width, kv_width, _ = cls.widths(lang)
        gated = 2 * q_width if lang.attention_output_gate else 0
        return (2 * q_width + 2 * kv_width * (1 + context_keys(cp)) + gated) / tp

    @staticmethod
    def attention_width(lang: LanguageConfig) -> float:
        """The width w of its ``4 L^2 w`` attention FLOPs: the query width (heads x head_dim)."""
        return lang.num_attention_heads * head_dim(lang)


class LatentAttention:
    """Multi-latent attention (transformers' ``DeepseekV3Attention``), as it trains (the latents expanded, not
    absorbed): q_a_proj [q_lora, h] with its RMSNorm and q_b_proj [heads (nope + rope), q_lora], or q_proj
    [heads (nope + rope), h] without a query latent; kv_a_proj_with_mqa [kv_lora + rope, h] with
    kv_a_layernorm [kv_lora]; kv_b_proj [heads (nope + v), kv_lora]; o_proj [h, heads v]; no biases."""

    @staticmethod
    def widths(lang: LanguageConfig) -> tuple[int, int]:
        """(query width: heads x (no-position + rotary channels), value width: heads x v_head_dim)."""
        mla, heads = lang.multi_latent_attention, lang.num_attention_heads
        return heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), heads * mla.v_head_dim

    @classmethod
    def parameters(cls, lang: LanguageConfig) -> int:
        mla, h, heads = lang.multi_latent_attention, lang.hidden_size, lang.num_attention_heads
        q_width, v_width = cls.widths(lang)
        if mla.q_lora_rank is None:
            query = linear_parameters(h, q_width, bias=False)
        else:
            query = (linear_parameters(h, mla.q_lora_rank, bias=False) + mla.q_lora_rank
                     + linear_parameters(mla.q_lora_rank, q_width, bias=False))
        key_value = (linear_parameters(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False) + mla.kv_lora_rank
                     + linear_parameters(mla.kv_lora_rank, heads * mla.qk_nope_head_dim + v_width, bias=False))
        return query + key_value + linear_parameters(v_width, h, bias=False)

    @classmethod
    def forward_flops(cls, lang: LanguageConfig, segment_lengths: Sequence[int]) -> int:
        """The query's down- and up-projections (or its one projection), the keys' and values' down-projection
        (with the shared rotary key) and up-projection, the output projection ``heads v -> h``, and attention
        within each segment, ``QK^T`` over the query width and ``AV`` over the value width."""
        mla, tokens, h = lang.multi_latent_attention, sum(segment_lengths), lang.hidden_size
        q_width, v_width = cls.widths(lang)
        if mla.q_lora_rank is None:
            query = linear_flops(tokens, h, q_width)
        else:
            query = linear_flops(tokens, h, mla.q_lora_rank) + linear_flops(tokens, mla.q_lora_rank, q_width)
        key_value = (linear_flops(tokens, h, mla.kv_lora_rank + mla.qk_rope_head_dim)
                     + linear_flops(tokens, mla.kv_lora_rank, lang.num_attention_heads * mla.qk_nope_head_dim
                                    + v_width))
        attention = sum(2 * length * length * (q_width + v_width) for length in segment_lengths)
        return query + key_value + linear_flops(tokens, v_width, h) + attention

    @staticmethod
    def saved_values_per_token(lang: LanguageConfig, tp: int, cp: int = 1) -> float:
        """The latents (the query's, the keys' and values' with the shared rotary key; gathered over TP, and
        their normed copies), then per head the query and key, the value and the attention output (under CP
        also the keys and values each local chunk sees, ``context_keys``), split over TP."""
        mla, heads = lang.multi_latent_attention, lang.num_attention_heads
        latents = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) + mla.qk_rope_head_dim
        qk, v = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
        return latents + heads * (2 * qk + 2 * v + (qk + v) * context_keys(cp)) / tp

    @classmethod
    def attention_width(cls, lang: LanguageConfig) -> float:
        """The mean of the query's and the values' widths: QK^T and AV differ."""
        q_width, v_width = cls.widths(lang)
        return (q_width + v_width) / 2


class SparseLatentAttention(LatentAttention):
    """DeepSeek Sparse Attention (transformers' ``DeepseekV32Attention``): multi-latent attention with the lightning
    indexer's ``wq_b`` [H D, q_lora], ``wk`` [D, h], ``k_norm`` (a LayerNorm: weight and bias [D]) and
    ``weights_proj`` [H, h] (H = index_n_heads, D = index_head_dim), no biases in the linears."""

    @classmethod
    def parameters(cls, lang: LanguageConfig) -> int:
        sparse, h = lang.sparse_attention, lang.hidden_size
        heads, dim = sparse.index_n_heads, sparse.index_head_dim
        indexer = (linear_parameters(lang.multi_latent_attention.q_lora_rank, heads * dim, bias=False)
                   + linear_parameters(h, dim, bias=False) + 2 * dim + linear_parameters(h, heads, bias=False))
        return super().parameters(lang) + indexer

    @staticmethod
    def indexer_flops(lang: LanguageConfig, segment_lengths: Sequence[int]) -> tuple[int, int]:
        """(forward, backward) FLOPs of the indexer and its KL loss in one layer. Forward: its projections (its
        queries from the query latent, its key and head weights from the hidden state), its scores (per head a q.k
        over each segment's square and their weighted sum) and, with the KL loss on, the loss's target (the main
        attention's q.k again over each square, from detached inputs). Backward (the KL loss's alone: the indexer's
        inputs are detached): the projections' weight gradients (once their forward) and the scores' (twice).
        Multi-latent attention itself is ``LatentAttention``'s: the CPU path masks the square rather than skipping
        what the top-k leaves out."""
        sparse, tokens, h = lang.sparse_attention, sum(segment_lengths), lang.hidden_size
        heads, dim = sparse.index_n_heads, sparse.index_head_dim
        projections = (linear_flops(tokens, lang.multi_latent_attention.q_lora_rank, heads * dim)
                       + linear_flops(tokens, h, dim + heads))
        scores = sum(2 * length * length * heads * (dim + 1) for length in segment_lengths)
        if sparse.indexer_loss_coeff <= 0:
            return projections + scores, 0
        mla = lang.multi_latent_attention
        target = sum(2 * length * length * lang.num_attention_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
                     for length in segment_lengths)
        return projections + scores + target, projections + 2 * scores


class WindowedFullAttention:
    """MiMo-V2-Flash's full-attention layers (``model.language.sliding_window`` set): q_proj [heads d, h], k_proj
    [groups d, h], v_proj [groups d_v, h], o_proj [h, heads d_v] (d: head_dim, d_v: its v_head_dim), no biases;
    ``groups`` the full layers' key/value heads. ``SlidingWindowAttention`` adds its sliding kind."""

    sliding = False

    @classmethod
    def widths(cls, lang: LanguageConfig) -> tuple[int, int, int]:
        """(query width heads x d, key width groups x d, value width groups x d_v)."""
        window, channels = lang.sliding_window, head_dim(lang)
        groups = window.num_query_groups if cls.sliding else lang.num_query_groups
        return lang.num_attention_heads * channels, groups * channels, groups * window.v_head_dim

    @classmethod
    def parameters(cls, lang: LanguageConfig) -> int:
        h, heads = lang.hidden_size, lang.num_attention_heads
        q_width, k_width, v_width = cls.widths(lang)
        sinks = heads if cls.sliding and lang.sliding_window.sinks else 0
        return (linear_parameters(h, q_width + k_width + v_width, bias=False)
                + linear_parameters(heads * lang.sliding_window.v_head_dim, h, bias=False) + sinks)

    @classmethod
    def seen_keys(cls, lang: LanguageConfig, length: int) -> int:
        """The keys the attention kernel multiplies per query of a ``length``-token segment: the full square, as
        every attention here (the SDPA path masks the window rather than skipping it), and in a sliding layer
        with sinks the sink's zero key."""
        return length + int(cls.sliding and lang.sliding_window.sinks)

    @classmethod
    def forward_flops(cls, lang: LanguageConfig, segment_lengths: Sequence[int]) -> int:
        """The projections, and per segment QK^T over the query width and AV over heads x d_v, each query
        against ``seen_keys`` keys (a kernel that skips what the window hides would do less)."""
        tokens, h = sum(segment_lengths), lang.hidden_size
        q_width, k_width, v_width = cls.widths(lang)
        heads_v = lang.num_attention_heads * lang.sliding_window.v_head_dim
        projections = linear_flops(tokens, h, q_width + k_width + v_width) + linear_flops(tokens, heads_v, h)
        attention = sum(2 * length * cls.seen_keys(lang, length) * (q_width + heads_v) for length in segment_lengths)
        return projections + attention

    @classmethod
    def saved_values_per_token(cls, lang: LanguageConfig, tp: int, cp: int = 1) -> float:
        """q, k, v (the scaled values too) and the attention output, split over TP (context parallelism is
        refused for these layers: ``SlidingWindowConfig.problems``, so ``cp`` is 1)."""
        q_width, k_width, v_width = cls.widths(lang)
        return (q_width + k_width + 2 * v_width + lang.num_attention_heads * lang.sliding_window.v_head_dim) / tp

    @classmethod
    def attention_width(cls, lang: LanguageConfig) -> float:
        """The mean of the query's and the values' widths: QK^T and AV differ."""
        return (lang.num_attention_heads * (head_dim(lang) + lang.sliding_window.v_head_dim)) / 2


class SlidingWindowAttention(WindowedFullAttention):
    """MiMo-V2-Flash's sliding-window layers: its full layers' projections with
    ``sliding_window.num_query_groups`` key/value heads and a learned sink logit per head."""

    sliding = True


def causal_conv_flops(tokens: int, shape: LinearAttentionConfig) -> int:
    """Gated DeltaNet's depthwise causal convolution over q, k, v: ``conv_kernel`` multiply-adds per
    channel and token."""
    channels = 2 * shape.num_key_heads * shape.key_head_dim + shape.num_value_heads * shape.value_head_dim
    return 2 * shape.conv_kernel * channels * tokens


def gated_delta_rule_flops(tokens: int, shape: LinearAttentionConfig, chunk: int = DELTA_RULE_CHUNK) -> int:
    """The chunked gated delta rule over ``tokens`` tokens, as fla's kernel multiplies it; q and k
    repeated over the value heads they serve, so every term is per value head.

    Per token and value head, ``6 d_k d_v + 2 C (3 d_k + 2 d_v)``:

    - ``3 x 2 d_k d_v`` against the chunk's starting state S [d_k, d_v]: the correction ``w S``
      (``v_new = u - w S``), the state update ``S <- decay S + K^T v_new`` and the read ``q S``;
    - ``2 C d_k`` three times and ``2 C d_v`` twice, a row of a C x C product each: ``beta K K^T``,
      ``w = A beta K``, ``Q K^T``, and ``u = A beta V``, ``(Q K^T) v_new`` (A: the chunk's solved
      unit-triangular system), over the whole C x C block as the kernel runs it (attention's
      full-square convention), per real token, so a sample's count is exactly linear in its length.

    The plain-torch ``models.decoder.linear_attention.chunked`` solves for ``u`` directly (a triangular solve,
    not a matmul) instead of the ``w`` and ``u`` products: ``2 C (d_k + d_v)`` fewer multiplications of
    its own."""
    dk, dv = shape.key_head_dim, shape.value_head_dim
    state = 3 * 2 * dk * dv
    within_chunk = 2 * chunk * (3 * dk + 2 * dv)
    return tokens * shape.num_value_heads * (state + within_chunk)


class GatedDeltaNet:
    """Gated DeltaNet's linear attention (transformers' ``Qwen3_5GatedDeltaNet``), with K = key heads x
    key_head_dim and V = value heads x value_head_dim: in_proj_qkv [2K + V, h], in_proj_z [V, h], in_proj_b
    and in_proj_a [value heads, h], the depthwise conv1d [2K + V, 1, conv_kernel] (no bias), dt_bias and A_log
    [value heads], the gated RMSNorm [value_head_dim] and out_proj [h, V]; no biases."""

    @staticmethod
    def widths(lang: LanguageConfig) -> tuple[int, int]:
        """(K, V): the key and value widths."""
        shape = lang.linear_attention
        return shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim

    @classmethod
    def parameters(cls, lang: LanguageConfig) -> int:
        shape, h = lang.linear_attention, lang.hidden_size
        key_width, value_width = cls.widths(lang)
        conv_channels = 2 * key_width + value_width  # q, k, v
        in_proj = linear_parameters(h, conv_channels + value_width + 2 * shape.num_value_heads, bias=False)
        per_value_head = 2 * shape.num_value_heads  # dt_bias, A_log
        return (in_proj + conv_channels * shape.conv_kernel + per_value_head + shape.value_head_dim
                + linear_parameters(value_width, h, bias=False))

    @classmethod
    def forward_flops(cls, lang: LanguageConfig, segment_lengths: Sequence[int]) -> int:
        """The input projection (q, k, v, the output gate z, and b, a per value head), the causal convolution,
        the gated delta rule and the output projection ``V -> h``. Every term is linear in the tokens: the
        state restarts at each segment, but no segment costs more per token for its length."""
        shape, tokens, h = lang.linear_attention, sum(segment_lengths), lang.hidden_size
        key_width, value_width = cls.widths(lang)
        in_proj_width = 2 * key_width + value_width + value_width + 2 * shape.num_value_heads  # q k v, z, b a
        projections = linear_flops(tokens, h, in_proj_width) + linear_flops(tokens, value_width, h)
        return projections + causal_conv_flops(tokens, shape) + gated_delta_rule_flops(tokens, shape)

    @classmethod
    def saved_values_per_token(cls, lang: LanguageConfig, tp: int, cp: int = 1) -> float:
        """The input projection's output (q, k, v before the convolution, z, b, a: 2K + 2V + 2H), the
        convolution's output, g and beta (the rule's inputs fla keeps: 2K + V + 2H), fla's solved chunk matrix
        (a row of ``DELTA_RULE_CHUNK`` per value head), the rule's output and the gated norm's (the output
        projection's input: 2V), split over TP. The recurrent state is recomputed in the backward, not kept.
        Under CP (``linear_attention_cp``): each token's window of the convolution's input (K taps, not one)
        and the rule's d_k widened value columns, in and out."""
        shape = lang.linear_attention
        key_width, value_width = cls.widths(lang)
        heads, qkv = shape.num_value_heads, 2 * key_width + value_width
        projection = qkv + value_width + 2 * heads
        rule_inputs = qkv + 2 * heads + heads * DELTA_RULE_CHUNK
        context = (shape.conv_kernel - 1) * qkv + 2 * heads * shape.key_head_dim if cp > 1 else 0
        return (projection + rule_inputs + 2 * value_width + context) / tp


def context_keys(cp: int) -> float:
    """Keys (and values) a CP rank's attention keeps per local token: its two chunks of each sample see the keys
    up to them, (r + 1) + (2 CP - r) chunks of 2 CP, CP + 1/2 times its own tokens (``models.layers.attention``
    gathers the row and copies each chunk's keys); none at CP 1 beyond its own."""
    return cp + 0.5 if cp > 1 else 0.0


def indexer_flops(lang: LanguageConfig, segment_lengths: Sequence[int]) -> tuple[int, int]:
    """(forward, backward) of what one full-attention layer runs beside the passes ``forward_flops`` counts (sparse
    attention's indexer and its loss: ``SparseLatentAttention.indexer_flops``); (0, 0) in a decoder without it."""
    return SparseLatentAttention.indexer_flops(lang, segment_lengths) if lang.sparse_attention is not None else (0, 0)


def token_mixer(lang: LanguageConfig, layer_type: str = FULL_ATTENTION):
    """The token mixer kind of a layer of ``layer_type`` (``model.language.layer_types``) in this decoder."""
    if lang.sliding_window is not None and layer_type in (FULL_ATTENTION, SLIDING_ATTENTION):
        return SlidingWindowAttention if layer_type == SLIDING_ATTENTION else WindowedFullAttention
    if layer_type == FULL_ATTENTION and lang.sparse_attention is not None:
        return SparseLatentAttention
    if layer_type == FULL_ATTENTION:
        return LatentAttention if lang.multi_latent_attention is not None else GroupedQueryAttention
    if layer_type == LINEAR_ATTENTION:
        return GatedDeltaNet
    raise ValueError(f"model.language.layer_types holds {layer_type!r}; expected {FULL_ATTENTION} or {LINEAR_ATTENTION}")


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


class DenseMLP:
    """The SwiGLU MLP: gate and up ``h -> ffn``, down ``ffn -> h``, no biases."""

    @staticmethod
    def parameters(lang: LanguageConfig, *, active: bool = False) -> int:
        return 3 * linear_parameters(lang.hidden_size, lang.ffn_hidden_size, bias=False)

    @staticmethod
    def forward_flops(lang: LanguageConfig, tokens: int, vision_tokens: int = 0) -> int:
        return linear_flops(tokens, lang.hidden_size, 3 * lang.ffn_hidden_size)

    @staticmethod
    def saved_values_per_token(lang: LanguageConfig, tp: int, expert_tp: int) -> float:
        """The gate, up and their product, split over TP."""
        return 3 * lang.ffn_hidden_size / tp


class Experts:
    """The mixture of experts (``model.language.moe``): the router ``h -> num_experts`` (its expert bias,
    DeepSeek-V3's, is a buffer, not a parameter, as in transformers), the routed SwiGLU experts of
    ``ffn_hidden_size`` (a token runs through ``router_topk``), and the shared expert every token runs
    through, SwiGLU of ``shared_expert_ffn_hidden_size`` (gated ``h -> 1`` in Qwen3.5-MoE), if any."""

    @staticmethod
    def routed_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
        """The routed experts (``active``: the ``router_topk`` one token runs through)."""
        moe = lang.moe
        experts = moe.router_topk if active else moe.num_experts
        return experts * 3 * linear_parameters(lang.hidden_size, moe.ffn_hidden_size, bias=False)

    @staticmethod
    def shared_parameters(lang: LanguageConfig) -> int:
        moe = lang.moe
        if not moe.shared_expert_ffn_hidden_size:
            return 0
        h = lang.hidden_size
        gate = linear_parameters(h, 1, bias=False) if moe.shared_expert_gate else 0
        return 3 * linear_parameters(h, moe.shared_expert_ffn_hidden_size, bias=False) + gate

    @classmethod
    def parameters(cls, lang: LanguageConfig, *, active: bool = False) -> int:
        router = linear_parameters(lang.hidden_size, lang.moe.num_experts, bias=False)
        return router + cls.routed_parameters(lang, active=active) + cls.shared_parameters(lang)

    @staticmethod
    def forward_flops(lang: LanguageConfig, tokens: int, vision_tokens: int = 0) -> int:
        """Every token alike (``vision_tokens``: of no account here)."""
        moe, h = lang.moe, lang.hidden_size
        shared = moe.shared_expert_ffn_hidden_size
        router = linear_flops(tokens, h, moe.num_experts)
        gate = 1 if moe.shared_expert_gate else 0
        shared_expert = linear_flops(tokens, h, 3 * shared + gate) if shared else 0
        return router + linear_flops(tokens * moe.router_topk, h, 3 * moe.ffn_hidden_size) + shared_expert

    @staticmethod
    def saved_values_per_token(lang: LanguageConfig, tp: int, expert_tp: int) -> float:
        """The top-k copies of the token routed to the experts, and their gate, up and product split over
        the expert TP, plus a shared expert's gate, up and product split over TP."""
        moe = lang.moe
        shared = 3 * (moe.shared_expert_ffn_hidden_size or 0) / tp
        return moe.router_topk * (lang.hidden_size + 3 * moe.ffn_hidden_size / expert_tp) + shared


class ModalityExperts:
    """Modality-isolated experts (``moe.vision_ffn_hidden_size``, ``decoder.modality_moe``): two routers
    ``h -> num_experts`` with their fixed biases (2 x num_experts values, parameters in transformers), the text
    set's ``num_experts`` SwiGLU experts of ``ffn_hidden_size`` and the vision set's of
    ``vision_ffn_hidden_size``, and the ungated shared experts. A token runs through its set's router and
    ``router_topk`` of its set's experts; ``active`` counts what a row of both modalities runs through (both
    routers, the top k of each set). The FLOPs and saved values, which do not know the tokens' modality, take
    every token as a text token, the costlier (the vision experts are the narrower)."""

    @staticmethod
    def routed_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
        moe, h = lang.moe, lang.hidden_size
        experts = moe.router_topk if active else moe.num_experts
        return experts * 3 * (linear_parameters(h, moe.ffn_hidden_size, bias=False)
                              + linear_parameters(h, moe.vision_ffn_hidden_size, bias=False))

    @classmethod
    def parameters(cls, lang: LanguageConfig, *, active: bool = False) -> int:
        routers = 2 * (linear_parameters(lang.hidden_size, lang.moe.num_experts, bias=False) + lang.moe.num_experts)
        return routers + cls.routed_parameters(lang, active=active) + Experts.shared_parameters(lang)

    @staticmethod
    def forward_flops(lang: LanguageConfig, tokens: int, vision_tokens: int = 0) -> int:
        """Each token through its set's router and ``router_topk`` of its set's experts (``vision_tokens`` of
        the ``tokens`` go to the vision set), and every token through the shared experts."""
        moe, h = lang.moe, lang.hidden_size
        shared = moe.shared_expert_ffn_hidden_size
        return (linear_flops(tokens, h, moe.num_experts)
                + linear_flops((tokens - vision_tokens) * moe.router_topk, h, 3 * moe.ffn_hidden_size)
                + linear_flops(vision_tokens * moe.router_topk, h, 3 * moe.vision_ffn_hidden_size)
                + (linear_flops(tokens, h, 3 * shared) if shared else 0))

    saved_values_per_token = Experts.saved_values_per_token


def mlp(lang: LanguageConfig, sparse: bool = True):
    """The MLP kind of a layer: the experts where the decoder has them and the layer is ``sparse`` (not one of
    DeepSeek's dense first layers), modality-isolated where it routes by modality, else the dense SwiGLU."""
    if not (lang.moe and sparse):
        return DenseMLP
    return ModalityExperts if lang.moe.vision_ffn_hidden_size else Experts
