"""DeepSeek Sparse Attention (``model.language.sparse_attention``): multi-latent attention whose queries each attend
to the ``index_topk`` keys a lightning indexer scores best, as transformers' ``DeepseekV32Attention`` /
``DeepseekV32Indexer`` compute it (fp32 scores, no Hadamard rotation, no FP8).

The indexer, per layer (x: the layer's normed input [L, h]; q_r: the query latent after its RMSNorm,
``q_a_layernorm(q_a_proj(x))`` [L, q_lora_rank], the same tensor MLA's query up-projection reads)::

    q[t, j]  = wq_b(q_r[t])[j]                      j < H heads of D = index_head_dim channels
    k[s]     = LayerNorm(wk(x[s]))                  one key per token, shared by the heads; LayerNorm with
                                                    weight and bias, eps 1e-6 (transformers' ``k_norm``)
    q, k     : RoPE on the FIRST R = qk_rope_head_dim channels of each head and of k, the rest pass;
               DeepSeek-V3.2 rotates halves (``rotate_half``, non-interleaved), unlike its MLA, which
               rotates interleaved pairs. The angles are MLA's (same table, YaRN's frequencies and its
               cos/sin factor mscale(f, mscale) / mscale(f, mscale_all_dim) included).
    w[t, j]  = weights_proj(x[t])[j] * H^-1/2      a signed weight per head and query
    I[t, s]  = sum_j w[t, j] * ReLU(D^-1/2 q[t, j] . k[s])
    I[t, s]  = -inf for s > t (and for s outside t's sample: see packing)
    S(t)     = topk(I[t, :], min(index_topk, L)) (torch.topk over the sample's row)

MLA then runs as DeepSeek-V3's with the mask "s in S(t) and s <= t": a selected key beyond the causal limit (a
query with fewer than index_topk earlier tokens takes every one of them and some masked ones) stays masked, so
that query attends to all its earlier tokens. No gradient flows through the choice (top-k is a selection), and
the indexer reads x and q_r detached: the LM loss never reaches the indexer, nor the indexer the main model.

Training (``stage``, DeepSeek-V3.2's paper, section 2.1). The indexer learns by its own loss alone, a KL toward
the main attention over the keys M(t) query t attends to::

    p[t, s]  = sum over every head n (all TP ranks') of softmax_s(scale * q_n[t] . k_n[s], s in M(t)), then
               divided by its sum over s (L1-normalised per query); computed from q, k detached
    KL(t)    = sum_{s in M(t)} p[t, s] * (log p[t, s] - log softmax_s(I[t, s], s in M(t)))
    loss     = mean over the micro-batch's queries of KL(t) (each sample of a packed row on its own block)

- ``dense_warmup``: M(t) = every s <= t (the attention runs dense), every parameter but the indexers' is frozen,
  the routers' expert bias too (``freeze_for_stage``, from the runner's freezing); the share of p that S(t) keeps
  is measured too.
- ``sparse`` (the published models' stage, and a converted checkpoint's default): M(t) = S(t) (and s <= t), everything
  trains, the main model by the LM loss (the indexer's inputs and the target are detached), the indexer by the KL.

Each layer's loss rides on its attention output as megatron's MoE balance loss does (``MoEAuxLossAutoScaler``: a
gradient injected in the backward, nothing added to the forward) at ``index_loss_coeff`` (the section's
``indexer_loss_coeff``), which the training step scales as ``moe_balance`` scales the balance loss's
(``weighted_indexer_loss``), so the objective is LM mean + coeff * sum over layers of the mean over the step's
micro-batches of each one's loss, however rows are spread over micro-batches and DP ranks. A packed row's padding
tail (a segment of its own, named by the step's ``PaddedRowParams``) is attended but left out of the loss, as the LM
loss's mask leaves it out: rows padded differently (TP pads to multiples of 8 TP) train the same indexer loss.

Ties at the cut. transformers takes ``torch.topk`` over the sample's scores [L] per query (its mask adds
finfo.min, which absorbs every score: the masked entries tie). The choice among tied scores at the cut (the
ReLU makes exact zeros common: a key no head scores above zero has I = 0) is whatever torch's CPU kernel
(``nth_element`` / ``partial_sort`` over the values alone) makes of that row; it depends only on the order
pattern of the row (which entries are larger, which equal), so this module calls the same ``topk`` on a row of
the same length and order pattern: the sample's own [L, L] block, computed with transformers' operations and
shapes (the masked entries -inf, equal among themselves as finfo.min's are). Ties then break as transformers'
do; a packed sample is scored on its own block, so packing changes nothing either.

Where it runs (the CPU reference path): masked dense, one sample at a time: the [L, L] index scores and a
boolean [L, L] mask into torch SDPA over the sample's keys. Memory is O(L^2) per sample, which a CPU row of a
few thousand tokens affords; a gather of the k selected keys per query would hold [L, k, heads, 192] instead,
larger than the mask for every L a CPU trains. The CUDA path (chunks of queries, no [L, L]) is a later part.

Packing. A packed row's samples (``cu_seqlens``) are scored and attended one by one: a query selects only
tokens of its own sample, at the positions its sample gives them (RoPE restarts per sample, as MLA's).

Tensor parallelism: the indexer is replicated (whole on every TP rank), not split by heads. The top-k needs the
score summed over ALL indexer heads; split heads would need an all-reduce of the [L, L] scores per layer (L^2
traffic, 64 GB at 128k), while the indexer's weights are small (DeepSeek-V3.2: 13.5M a layer beside MLA's 187M).
Every TP rank computes the same scores and the same choice from the same inputs: under sequence parallelism the
inputs are gathered along the sequence first (without autograd: they are detached).

GLM-5 (transformers' ``glm_moe_dsa``) differs in two ways: its indexer rotates interleaved pairs (``rope_interleaved``:
``rotate_pairs``, transformers' ``apply_rotary_pos_emb_interleave``, whose output holds the rotated even channels,
then the odd ones, for q and k alike), and its config may mark layers "shared", which reuse the top-k of the last
"full" layer instead of running an indexer (transformers' ``indexer_types``; not built here: such a config is refused,
and the published one, ``index_topk_freq`` 1, has none).
The published kernels differ from transformers (and this module) in the indexer's precision only: they rotate q
and k by a Hadamard transform (orthogonal, so every q.k is unchanged) and score in FP8.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from loongforge.models.decoder.moe_balance import scaled_coefficient
from loongforge.models.layers.attention import SDPACoreAttention

KEY_NORM_EPS = 1e-6  # transformers' indexer k_norm (a LayerNorm), whatever rms_norm_eps says


@dataclass
class SparseAttentionTransformerConfig(MLATransformerConfig):
    """megatron's MLA settings plus the indexer's (``configs.sparse_attention``)."""

    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_rope_interleaved: bool = False
    index_stage: str = "sparse"  # "dense_warmup" | "sparse" (the section's ``stage``)
    index_loss_coeff: float = 1.0  # the section's ``indexer_loss_coeff``; the step scales it (module docstring)

    @property
    def dense_warmup(self) -> bool:
        return self.index_stage == "dense_warmup"


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., R] with channel i paired with i + R/2 (transformers' ``rotate_half``); cos/sin [..., R] (the
    frequencies twice) broadcast."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., R] with channels (2i, 2i+1) a pair, written back as [rotated evens, rotated odds] (transformers'
    ``apply_rotary_pos_emb_interleave``: q and k alike, so every q.k is that of the interleaved layout)."""
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class LightningIndexer(MegatronModule):
    """The indexer's weights (transformers' names: ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``), whole on every TP
    rank; ``select`` gives one sample's top-k keys per query."""

    def __init__(self, config: SparseAttentionTransformerConfig):
        super().__init__(config=config)
        heads, dim, dtype = config.index_n_heads, config.index_head_dim, config.params_dtype
        self.heads, self.dim, self.topk, self.rotary = heads, dim, config.index_topk, config.qk_pos_emb_head_dim
        self.rotate = rotate_pairs if config.index_rope_interleaved else rotate_halves
        self.linear_wq_b = torch.nn.Linear(config.q_lora_rank, heads * dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(config.hidden_size, dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(dim, eps=KEY_NORM_EPS, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False, dtype=dtype)
        if config.perform_initialization:  # as megatron's router: replicated, drawn from the default generator
            for linear in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
                config.init_method(linear.weight)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One sample's index scores [L, L] (-inf above the diagonal), from x [L, h], q_latent [L, q_lora_rank]
        and the rotary cos/sin [L, R], by transformers' operations at its shapes (batch 1)."""
        length = x.shape[0]
        q = self.linear_wq_b(q_latent).view(1, length, self.heads, self.dim)  # [1, L, H, D]
        q_rot, q_pass = q.split([self.rotary, self.dim - self.rotary], dim=-1)
        k = self.k_norm(self.linear_wk(x)).view(1, length, 1, self.dim)  # [1, L, 1, D]
        k_rot, k_pass = k.split([self.rotary, self.dim - self.rotary], dim=-1)
        cos, sin = cos[None, :, None], sin[None, :, None]  # [1, L, 1, R]
        q = torch.cat([self.rotate(q_rot, cos, sin), q_pass], dim=-1)
        k = torch.cat([self.rotate(k_rot, cos, sin), k_pass], dim=-1).squeeze(2)  # [1, L, D]
        per_head = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.dim**-0.5
        per_head = F.relu(per_head)  # [1, L, H, L]
        weights = self.linear_weights_proj(x).float().view(1, length, self.heads) * self.heads**-0.5  # [1, L, H]
        scores = torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)[0]  # [L, L]
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        return scores.masked_fill(future, float("-inf"))

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One sample's attention mask [L, L], True where query t attends key s: s among t's top-k and s <= t."""
        return self.keep(self.scores(x.detach(), q_latent.detach(), cos, sin).detach())

    def keep(self, scores: torch.Tensor) -> torch.Tensor:
        """The mask [L, L] of one sample's index scores [L, L] (-inf above the diagonal): s among t's top-k, s <= t."""
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices  # [L, k]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        return keep & torch.isfinite(scores)


def attention_target(query: torch.Tensor, key: torch.Tensor, scale: float, mask: torch.Tensor,
                     tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The indexer's target p [L, L] (module docstring) from one sample's query, key [L, np, d] (this rank's heads,
    detached here) and the attended mask [L, L]: softmax per head over the mask, summed over all heads (over the TP
    group's too), L1-normalised per query. fp32."""
    q, k = query.detach().float().transpose(0, 1), key.detach().float().transpose(0, 1)  # [np, L, d]
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [np, L, L]
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).sum(0)  # [L, L]
    if tp_group is not None and tp_group.size() > 1:  # each rank holds np / tp heads
        dist.all_reduce(probs, group=tp_group)
    return probs / probs.sum(dim=-1, keepdim=True)


def indexer_kl(scores: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p[t] || softmax(I[t] over the mask)) per query [L] from one sample's index scores [L, L] (the gradient's
    only way in), the target p [L, L] (zero off the mask) and the mask [L, L]."""
    log_q = torch.log_softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1)  # [L, L]
    counted = mask & (target > 0)  # 0 * log 0 = 0; where() also keeps the -inf off the mask out of the gradient
    return torch.where(counted, target * (target.log() - log_q), 0.0).sum(dim=-1)


class SparseCoreAttention(SDPACoreAttention):
    """SDPA over one sample's keys under the indexer's mask."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """q, k [L, np, d], v [L, np, d_v], keep [L, L] -> [L, np, d_v]."""
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, np, L, d]
        return self._sdpa(q, k, v, False, keep)[0].transpose(0, 1)


class SparseLatentAttention(MLASelfAttention):
    """Multi-latent attention with the lightning indexer: [s(/tp), b, h] -> ([s(/tp), b, h], bias). megatron's MLA
    projects q, k, v and applies its RoPE; this module chooses the keys and attends sample by sample (the
    training path: no KV cache)."""

    def __init__(self, config: SparseAttentionTransformerConfig, submodules, layer_number: int, attn_mask_type,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.indexer = LightningIndexer(config)

        # This rank's training statistics since the step took them (``take_indexer_statistics``): float64
        # [KL summed over micro-batches, top-k kept mass summed likewise (dense_warmup), micro-batches].
        self.indexer_statistics: Optional[torch.Tensor] = None

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused):
        query, key, value, q_latent, _ = self.get_query_key_value_tensors(
            hidden_states, packed_seq_params=packed_seq_params)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        # The indexer reads detached inputs: the LM loss never reaches it, nor its KL the main model.
        x, q_latent = hidden_states.detach(), q_latent.detach()
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:  # the indexer reads every token
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            q_latent = gather_from_sequence_parallel_region(q_latent, group=self.pg_collection.tp)
        learn = self.training and torch.is_grad_enabled()
        if packed:  # [t, np, d] and [t, 1, h], [t, q_lora_rank]: one sample per segment of cu_seqlens
            spans = _spans(packed_seq_params.cu_seqlens_q)
            # The padding tail (``PaddedRowParams``) is attended as a segment but left out of the indexer's loss.
            samples = len(spans) - int(0 < getattr(packed_seq_params, "padding_tokens", 0) == spans[-1][1])
            out, losses = self._attend_samples(query, key, value, x[:, 0], q_latent, spans, samples if learn else 0)
        else:  # [s, b, ...]: each batch row one sample of s tokens
            rows = [self._attend_samples(query[:, b], key[:, b], value[:, b], x[:, b], q_latent[:, b],
                                         [(0, query.shape[0])], int(learn)) for b in range(query.shape[1])]
            out = torch.stack([row for row, _ in rows], dim=1)  # [s, b, np, d_v]
            losses = [loss for _, row_losses in rows for loss in row_losses]
        if losses:
            out = self._attach_indexer_loss(out, losses)
        # [t, np, d_v] -> [t, 1, np * d_v]; [s, b, np, d_v] -> [s, b, np * d_v]
        return self.linear_proj(out.reshape(out.shape[0], 1 if packed else out.shape[1], -1))

    def _attend_samples(self, query, key, value, x, q_latent, spans: list[tuple[int, int]], learned_spans: int
                        ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """q, k [t, np, d], v [t, np, d_v], x [t, h], q_latent [t, q_lora_rank] (detached) -> [t, np, d_v], each
        (start, length) span of ``spans`` a sample of its own; also the (KL [L], top-k kept mass [L]) per query of
        the first ``learned_spans`` spans (module docstring)."""
        cos, sin = self._rotary_table(max(length for _, length in spans), x.dtype)
        outputs, losses = [], []
        for index, (start, length) in enumerate(spans):
            rows, learning = slice(start, start + length), index < learned_spans
            with torch.set_grad_enabled(learning):  # the indexer's graph only when its loss trains it
                scores = self.indexer.scores(x[rows], q_latent[rows], cos[:length], sin[:length])  # [L, L]
            chosen = self.indexer.keep(scores.detach())
            attended = torch.isfinite(scores.detach()) if self.config.dense_warmup else chosen
            outputs.append(self.core_attention.attend(query[rows], key[rows], value[rows], attended))
            if learning:
                target = attention_target(query[rows], key[rows], self._softmax_scale(query), attended,
                                          self.pg_collection.tp)
                losses.append((indexer_kl(scores, target, attended), (target * chosen).sum(dim=-1)))
        return torch.cat(outputs), losses

    def _attach_indexer_loss(self, out: torch.Tensor, losses: list[tuple[torch.Tensor, torch.Tensor]]
                             ) -> torch.Tensor:
        """The micro-batch's indexer loss (mean KL over its queries) injected into the backward through ``out``,
        at the coefficient the step set; the statistics recorded."""
        kl = torch.cat([loss for loss, _ in losses]).mean()
        mass = torch.cat([kept for _, kept in losses]).mean()
        record = torch.stack([kl.detach().double(), mass.double(), torch.ones((), dtype=torch.float64,
                                                                                device=mass.device)])
        self.indexer_statistics = record if self.indexer_statistics is None else self.indexer_statistics + record
        return MoEAuxLossAutoScaler.apply(out, kl * self.config.index_loss_coeff)

    def _softmax_scale(self, query: torch.Tensor) -> float:
        """MLA's softmax scale (YaRN's mscale in it), as the core attention applies it."""
        scale = self.core_attention.softmax_scale
        return query.shape[-1] ** -0.5 if scale is None else scale

    def _rotary_table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, R] of positions 0.. as MLA's rotary module gives them (YaRN's factor folded in)."""
        if self.config.rope_type == "rope":
            angles, mscale = self.rotary_pos_emb(length, packed_seq=True), 1.0
        else:
            angles, mscale = self.rotary_pos_emb(length, packed_seq=True)
        angles = angles.reshape(length, -1)  # [L, R]: the frequencies twice, halves layout
        return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each non-empty segment of a packed row."""
    cu = cu_seqlens.tolist()
    return [(start, end - start) for start, end in zip(cu[:-1], cu[1:]) if end > start]


def sparse_attention_layers(modules: Sequence[torch.nn.Module]) -> list[SparseLatentAttention]:
    """Every DeepSeek Sparse Attention layer inside ``modules`` (model chunks, possibly DDP-wrapped)."""
    return [m for module in modules for m in module.modules() if isinstance(m, SparseLatentAttention)]


def freeze_for_stage(model: torch.nn.Module) -> bool:
    """``stage=dense_warmup``: every parameter of ``model`` but its indexers' takes no gradient, and the routers'
    expert bias (trained state megatron-core moves after each step by ``moe_router_bias_update_rate`` toward an even
    load) stays put: the rate is 0 for the run. The token embedding's output asks for a gradient all the same:
    activation recompute reruns a layer in the backward only if its input wants one, and the indexer loss rides on
    that backward. True where done (False: not a warm-up, nothing changed)."""
    layers = sparse_attention_layers([model])
    if not layers or not layers[0].config.dense_warmup:
        return False
    model.requires_grad_(False)
    for layer in layers:
        layer.indexer.requires_grad_(True)
    for module in model.modules():
        if isinstance(module, LanguageModelEmbedding):
            module.register_forward_hook(_wants_gradient)
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "moe_router_bias_update_rate", None):
            config.moe_router_bias_update_rate = 0.0
    return True


def _wants_gradient(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output [s, b, h], a leaf, made to want a gradient (``freeze_for_stage``)."""
    return output if output.requires_grad or not torch.is_grad_enabled() else output.requires_grad_(True)


@contextmanager
def weighted_indexer_loss(model_chunks: Sequence[torch.nn.Module], factor: float) -> Iterator[None]:
    """The indexer loss's coefficient times ``factor`` (``moe_balance.aux_loss_weight``'s, for the same objective)
    for one step's forward and backward, then restored."""
    with scaled_coefficient([layer.config for layer in sparse_attention_layers(model_chunks)], "index_loss_coeff",
                            factor):
        yield


def take_indexer_statistics(model_chunks: Sequence[torch.nn.Module]) -> torch.Tensor:
    """This rank's float64 [KL, top-k kept mass, (layer, micro-batch) pairs] summed over its sparse layers and the
    micro-batches they trained on since the last call (zeros for none), then forgotten. Mean over layers and
    micro-batches: the first two over the third."""
    total = torch.zeros(3, dtype=torch.float64)
    for layer in sparse_attention_layers(model_chunks):
        if layer.indexer_statistics is not None:
            total += layer.indexer_statistics.cpu()
            layer.indexer_statistics = None
    return total
