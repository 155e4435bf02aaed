"""megatron-core layer specs of the decoder every family builds, and the pre-norm block its towers share.

The modules come from ``loongforge.models.layers.layer_backend`` (Transformer Engine's, or local linears
with SDPA / flash-attn); this file only arranges them. Each pre-norm is fused into the linear after
it (``linear_qkv`` and ``linear_fc1`` hold ``layer_norm_weight``), so the layer's own norm slots are
identities and the state-dict names do not depend on the backend. Families build their vision
towers from ``transformer_layer_spec`` with a bidirectional mask.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from loongforge.models.decoder.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from loongforge.models.decoder.modality_moe import modality_moe_spec
from loongforge.models.layers.layer_qk_norm import LayerQKNorm
from loongforge.models.decoder.sliding_attention import SlidingWindowAttention, SlidingWindowAttentionSubmodules
from loongforge.models.decoder.sparse_attention import (
    SparseAttentionTransformerConfig,
    SparseCoreAttention,
    SparseLatentAttention,
)
from loongforge.models.layers.initialization import SeededTransformerLayer
from loongforge.models.layers.layer_backend import BlockModules, RMSNorm


def projector_mlp_submodules(modules: BlockModules) -> MLPSubmodules:
    """The merger MLP: column-parallel up-projection, row-parallel down-projection, no fused norm
    (its norm runs per patch, before the merge units are concatenated)."""
    return MLPSubmodules(linear_fc1=modules.column_linear, linear_fc2=modules.row_linear)


def moe_spec(modules: BlockModules, *, shared_expert: bool = False) -> ModuleSpec:
    """megatron-core's MoE layer: its top-k router, its token dispatcher (the one sort into expert order, and back), the
    experts of ``modules.experts`` (one SwiGLU MLP of plain column/row linears each, drawn from their global
    expert index: run one by one, ``SeededSequentialMLP``, or by grouped GEMMs, ``GroupedExperts``);
    ``shared_expert``: megatron's gated ``SharedExpertMLP`` beside them. The settings (softmax top-k, the
    dispatcher, the shared expert's width) are the TransformerConfig's (``configs.experts``)."""
    expert = MLPSubmodules(linear_fc1=modules.column_linear, linear_fc2=modules.row_linear)
    shared = None
    if shared_expert:
        # MoELayer passes gate=config.moe_shared_expert_gate (configs.experts sets it).
        shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
            linear_fc1=modules.column_linear, linear_fc2=modules.row_linear))
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=modules.experts_module, submodules=expert), shared_experts=shared))


def transformer_layer_spec(modules: BlockModules, attn_mask_type: AttnMaskType, *,
                           qk_norm: bool = False, moe: bool = False, shared_expert: bool = False,
                           vision_ffn_hidden_size: Optional[int] = None) -> ModuleSpec:
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); each norm inside the next linear.
    ``qk_norm``: RMSNorm over each head's query and key before the rotary embedding (Qwen3).
    ``moe``: the MLP is megatron's MoE layer; the router and every expert read the normed hidden
    state, so that norm is a module of its own (``pre_mlp_layernorm``: megatron's own MoE specs
    name it so, and ``state_dict_names`` reads it as the fused ``mlp.linear_fc1.layer_norm_weight``
    row of the weight map). ``vision_ffn_hidden_size``: the sparse MLP holds modality-isolated experts, the
    vision tokens' this wide (``decoder.modality_moe``)."""
    head_norm = RMSNorm if qk_norm else IdentityOp
    if moe and vision_ffn_hidden_size:
        routed = moe_spec(modules)
        shared = moe_spec(modules, shared_expert=True).submodules.shared_experts if shared_expert else None
        pre_mlp_norm, mlp = RMSNorm, modality_moe_spec(routed, routed, shared, vision_ffn_hidden_size)
    elif moe:
        pre_mlp_norm, mlp = RMSNorm, moe_spec(modules, shared_expert=shared_expert)
    else:
        pre_mlp_norm, mlp = IdentityOp, ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=modules.norm_column_linear, linear_fc2=modules.row_linear))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": attn_mask_type},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=modules.norm_column_linear,
                    core_attention=modules.core_attention,
                    linear_proj=modules.row_linear,
                    q_layernorm=head_norm,
                    k_layernorm=head_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm


class LatentNorm(RMSNorm):
    """The query latent's RMSNorm as a module of its own (sparse attention's indexer reads its output as MLA's
    up-projection does), at DeepSeek's epsilon whatever megatron passes (its ``q_layernorm`` slot gives
    rms_norm_eps)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = LATENT_NORM_EPS, **unused):
        super().__init__(config, hidden_size, LATENT_NORM_EPS)


def mla_layer_spec(modules: BlockModules, *, moe: bool = False, shared_expert: bool = False,
                   sparse: bool = False) -> ModuleSpec:
    """A multi-latent attention layer (DeepSeek-V2/V3): the input norm a module of its own (both latent
    projections read it), the latents' RMSNorms fused into the up-projections after them
    (``linear_q_up_proj`` / ``linear_kv_up_proj`` hold ``layer_norm_weight``, as in megatron's TE spec), the
    down-projections column-parallel with their outputs gathered (megatron's MLA does); then the MLP as in
    ``transformer_layer_spec``. ``sparse``: DeepSeek Sparse Attention (``decoder.sparse_attention``), whose indexer
    reads the normed query latent too, so that norm is a module of its own (``q_layernorm``)."""
    spec = transformer_layer_spec(modules, AttnMaskType.causal, moe=moe, shared_expert=shared_expert)
    spec.submodules.input_layernorm = RMSNorm
    # transformers' latent RMSNorms keep their class default epsilon (1e-6) whatever rms_norm_eps says
    # (Moonlight's is 1e-5); Transformer Engine's norm-linear takes the config's.
    latent = modules.norm_column_linear if modules.backend == "te" else ModuleSpec(
        module=modules.norm_column_linear, params={"norm_eps": LATENT_NORM_EPS})
    spec.submodules.self_attention = ModuleSpec(
        module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=modules.column_linear, linear_q_down_proj=modules.column_linear,
            linear_q_up_proj=latent, linear_kv_down_proj=modules.column_linear,
            linear_kv_up_proj=latent, core_attention=modules.core_attention,
            linear_proj=modules.row_linear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp))
    if sparse:
        attention = spec.submodules.self_attention
        attention.module = SparseLatentAttention
        attention.submodules.linear_q_up_proj, attention.submodules.q_layernorm = modules.column_linear, LatentNorm
        attention.submodules.core_attention = SparseCoreAttention
    return spec


def linear_attention_layer_spec(modules: BlockModules, *, moe: bool = False, shared_expert: bool = False) -> ModuleSpec:
    """A hybrid model's linear-attention layer: x + GatedDeltaNet(norm(x)), then the MLP as in
    ``transformer_layer_spec`` (the pre-norm fused into the projection, ``in_proj.layer_norm_weight``)."""
    if modules.linear_attention is None:
        raise ValueError("block modules built without a gated delta rule: "
                         "block_modules(..., linear_attention_layers=True)")
    spec = transformer_layer_spec(modules, AttnMaskType.causal, moe=moe, shared_expert=shared_expert)
    spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=modules.norm_column_linear, out_proj=modules.row_linear, rule=modules.linear_attention))
    return spec


def sliding_window_layer_spec(modules: BlockModules, *, sliding: bool, moe: bool = False,
                              shared_expert: bool = False) -> ModuleSpec:
    """A layer of MiMo-V2-Flash's attention (``sliding``: its sliding-window kind, else its full kind): x +
    SlidingWindowAttention(norm(x)), the pre-norm fused into ``linear_qkv``; then the MLP as in
    ``transformer_layer_spec``."""
    spec = transformer_layer_spec(modules, AttnMaskType.causal, moe=moe, shared_expert=shared_expert)
    spec.submodules.self_attention = ModuleSpec(
        module=SlidingWindowAttention, params={"sliding": sliding},
        submodules=SlidingWindowAttentionSubmodules(linear_qkv=modules.norm_column_linear,
                                                    linear_proj=modules.row_linear))
    return spec


def language_layer_spec(modules: BlockModules, init_seed: int | None = None, *, qk_norm: bool = False,
                        moe: bool = False, shared_expert: bool = False, linear: bool = False,
                        latent: bool = False, vision_ffn_hidden_size: Optional[int] = None,
                        layer_qk_norm_group=None, sliding: bool | None = None, sparse: bool = False) -> ModuleSpec:
    """The decoder layer (``linear``: a Gated DeltaNet layer; ``latent``: multi-latent attention; ``sliding``:
    MiMo-V2-Flash's attention, its sliding kind when true, its full kind when false; ``sparse``: multi-latent
    attention under DeepSeek Sparse Attention's indexer); with ``init_seed``, each
    layer's initial weights come from (seed, its global index), whatever the pipeline layout (see
    ``models.layers.initialization``). ``vision_ffn_hidden_size``: a sparse layer holds modality-isolated experts
    (``decoder.modality_moe``); ``layer_qk_norm_group``: the TP group of q/k norms over all heads
    (``layer_qk_norm``; None: per head or none)."""
    if sliding is not None:
        spec = sliding_window_layer_spec(modules, sliding=sliding, moe=moe, shared_expert=shared_expert)
    elif latent:
        spec = mla_layer_spec(modules, moe=moe, shared_expert=shared_expert, sparse=sparse)
    elif linear:
        spec = linear_attention_layer_spec(modules, moe=moe, shared_expert=shared_expert)
    else:
        spec = transformer_layer_spec(modules, AttnMaskType.causal, qk_norm=qk_norm, moe=moe, shared_expert=shared_expert,
                                      vision_ffn_hidden_size=vision_ffn_hidden_size)
        if layer_qk_norm_group is not None:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm, attention.k_layernorm = (
                ModuleSpec(module=LayerQKNorm, params={"heads": heads, "tp_group": layer_qk_norm_group})
                for heads in ("query", "key"))
    if init_seed is not None:
        spec.module = SeededTransformerLayer
        spec.params = {"init_seed": init_seed, "init_key": "language_model.decoder.layers"}
    return spec


def language_block_spec(
    config: TransformerConfig, modules: BlockModules, *, pp_rank: int, vp_stage: int | None = None,
    init_seed: int | None = None, vision_ffn_hidden_size: Optional[int] = None, layer_qk_norm_group=None,
) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder layers plus the final norm (a ``TransformerBlock`` spec);
    ``vision_ffn_hidden_size``: the sparse layers hold modality-isolated experts (``decoder.modality_moe``);
    ``layer_qk_norm_group`` as ``language_layer_spec``'s.

    Given as block submodules rather than a layer spec so that the final norm is our ``RMSNorm``
    and not megatron's global default norm class.
    """
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    pattern = config.linear_attention_freq or [0] * config.num_layers  # 1: a linear-attention layer
    sliding = getattr(config, "sliding_layer_pattern", None)  # MiMo-V2-Flash's attention: 1 a sliding layer
    sparse = _sparse_layers(config)
    shared_expert = bool(config.moe_shared_expert_intermediate_size)
    layers = [language_layer_spec(modules, init_seed, qk_norm=config.qk_layernorm, moe=sparse[first + local],
                                  shared_expert=shared_expert and sparse[first + local],
                                  linear=bool(pattern[first + local]), latent=config.multi_latent_attention,
                                  vision_ffn_hidden_size=vision_ffn_hidden_size,
                                  layer_qk_norm_group=layer_qk_norm_group,
                                  sliding=None if sliding is None else bool(sliding[first + local]),
                                  sparse=_sparse_attention(config))
              for local in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def mtp_block_spec(config: TransformerConfig, modules: BlockModules, init_seed: int | None = None):
    """megatron's multi-token-prediction block: per MTP layer RMSNorms on the next token's embedding and on
    the hidden state, their concatenation projected back to the hidden size (``eh_proj``, column-parallel,
    gathered), a decoder layer as the model's last (sparse where the model has experts), and a final RMSNorm
    before the shared output head."""
    from megatron.core.transformer.multi_token_prediction import (  # lazy: only models with MTP layers
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )

    sparse = bool(config.num_moe_experts)
    layer = language_layer_spec(modules, init_seed, qk_norm=config.qk_layernorm, moe=sparse,
                                shared_expert=sparse and bool(config.moe_shared_expert_intermediate_size),
                                latent=config.multi_latent_attention, sparse=_sparse_attention(config))
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=RMSNorm, hnorm=RMSNorm, eh_proj=modules.column_linear, transformer_layer=layer, layer_norm=RMSNorm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * config.mtp_num_layers)


def _sparse_attention(config: TransformerConfig) -> bool:
    """Whether the layers' multi-latent attention runs under DeepSeek Sparse Attention's indexer."""
    return isinstance(config, SparseAttentionTransformerConfig)


def _sparse_layers(config: TransformerConfig) -> list[bool]:
    """Whether each decoder layer is an MoE layer: every one in a model with experts, less the dense first
    layers of a ``moe_layer_freq`` pattern (``configs.moe_layer_pattern``)."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    if isinstance(config.moe_layer_freq, list):
        return [bool(kind) for kind in config.moe_layer_freq]
    return [True] * config.num_layers
