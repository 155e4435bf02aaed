"""The parallel plan ``--dry-run`` prints: sizes, batches, parameters and memory per rank.

Pure arithmetic over a validated RunConfig: it has to work for a 235B preset on a laptop.
Parameter counts come from the model family's own arithmetic
(``ModelFamily.count_parameters``), split into the parts pipeline stages
hold by counting the model again without its decoder layers, and with one layer of each type (a
hybrid decoder's full- and linear-attention layers differ; a stage holds the ones its layer range
names). A mixture-of-experts layer's experts are split over EP x expert TP ranks (and their optimizer
state over the expert data-parallel ranks), the rest of the layer over TP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loongforge.config.layout import (
    ParallelSizes,
    data_parallel_settings,
    derive_parallel_sizes,
    encoder_shared_over_context,
    resolve_read,
    sample_multiple,
)
from loongforge.config.pipeline_layout import PipelineStages, stage_plan
from loongforge.config.schema import LanguageConfig, ModelConfig, RunConfig
from loongforge.models import parts
from loongforge.models.decoder.layer_costs import LatentAttention, SparseLatentAttention, mlp, token_mixer
from loongforge.models.flops import decoder_layer_types, sparse_layers, with_layers
from loongforge.models.layers.lora_params import AdapterParameters, adapter_parameters
from loongforge.models.registry import check_family_layout, get_family

GIB = 1024**3
# A layer kind is its token mixer (``flops.decoder_layer_types``), with this suffix where a model with
# experts keeps the dense MLP (DeepSeek's first layers): such a layer holds no experts and a wide MLP.
DENSE_MLP = "+dense_mlp"


def decoder_layer_kinds(language: LanguageConfig) -> list[str]:
    """Each decoder layer's kind, in order (``DENSE_MLP``)."""
    return [kind if sparse or not language.moe else kind + DENSE_MLP
            for kind, sparse in zip(decoder_layer_types(language), sparse_layers(language))]


def _mixer(kind: str) -> str:
    return kind.removesuffix(DENSE_MLP)


def total_parameters(model: ModelConfig) -> int:
    return int(get_family(model.family).count_parameters(model)["total"])


@dataclass(frozen=True)
class ParameterSplit:
    """Parameters by where pipeline stages keep them."""

    total: int
    vision_and_projector: int  # first stage (all with encoder_dp=full); plus the final norm's weights
    per_decoder_layer: float  # everything but the routed experts (split over TP); the mean over the layers
    input_embedding: int  # first stage
    output_head: int  # last stage; 0 when tied and everything is one stage
    experts_per_decoder_layer: int = 0  # routed experts of a sparse layer (split over EP x expert TP)
    active: int = 0  # parameters one token runs through
    vision_model: int = 0  # the vision tower's part of vision_and_projector
    projector: int = 0  # the projector's part
    # One layer of each kind (``decoder_layer_kinds``: "full_attention", "linear_attention", either with
    # DENSE_MLP) but its routed experts; a decoder without ``layer_types`` has full attention only.
    per_layer_by_type: dict[str, float] = dataclasses.field(default_factory=dict)
    # The multi-token-prediction layers (last stage) but their routed experts, and their routed experts.
    mtp: float = 0.0
    mtp_experts: int = 0

    def layers_parameters(self, layer_kinds: list[str]) -> float:
        """The layers of ``layer_kinds`` (one entry per layer) but their routed experts."""
        return sum(self.per_layer_by_type.get(kind, self.per_decoder_layer) for kind in layer_kinds)

    def experts_of(self, layer_kinds: list[str]) -> int:
        """The routed experts of the layers of ``layer_kinds`` (none in a dense-MLP layer)."""
        return self.experts_per_decoder_layer * sum(not kind.endswith(DENSE_MLP) for kind in layer_kinds)


def split_parameters(model: ModelConfig) -> ParameterSplit:
    language = model.language
    counts = get_family(model.family).count_parameters(model)
    total = int(counts["total"])
    without_layers = total_parameters(dataclasses.replace(model, language=with_layers(language, 0, mtp_num_layers=0)))
    mtp = total - total_parameters(dataclasses.replace(model, language=dataclasses.replace(language, mtp_num_layers=0)))
    embedding = language.vocab_size * language.hidden_size
    head = 0 if language.tie_word_embeddings else embedding
    routed = int(counts["routed_experts"])
    experts = routed // max(sum(sparse_layers(language)) + language.mtp_num_layers, 1)
    mtp_experts = experts * language.mtp_num_layers if language.moe else 0
    one_of_each = {kind: total_parameters(_with_one_layer(model, kind)) - without_layers
                   - (0 if kind.endswith(DENSE_MLP) else experts)
                   for kind in dict.fromkeys(decoder_layer_kinds(language))}
    return ParameterSplit(
        total=total,
        vision_and_projector=max(without_layers - embedding - head, 0),
        per_decoder_layer=(total - mtp - without_layers - routed + mtp_experts) / language.num_layers,
        input_embedding=embedding,
        output_head=head,
        experts_per_decoder_layer=experts,
        active=int(counts["active"]),
        vision_model=int(counts["vision_model"]),
        projector=int(counts["projector"]),
        per_layer_by_type=one_of_each,
        mtp=mtp - mtp_experts,
        mtp_experts=mtp_experts,
    )


def _with_one_layer(model: ModelConfig, kind: str) -> ModelConfig:
    """``model`` with a single decoder layer, of ``kind`` (``decoder_layer_kinds``)."""
    language = model.language
    layer_types = [_mixer(kind)] if language.layer_types else []
    return dataclasses.replace(model, language=with_layers(
        language, 1, first_dense=int(kind.endswith(DENSE_MLP)), layer_types=layer_types, mtp_num_layers=0))


def rank_layer_types(stages: PipelineStages, layer_types: list[str], rank: int) -> list[str]:
    """The types of the layers pipeline rank ``rank`` holds, over all its virtual stages."""
    return [layer_types[index] for chunk, count in enumerate(stages.layers[rank])
            for index in range(stages.first_layer(rank, chunk), stages.first_layer(rank, chunk) + count)]


@dataclass(frozen=True)
class StagePlan:
    index: int
    layer_ranges: tuple[tuple[int, int], ...]  # [first, last] of each chunk's layers (one chunk without VP)
    num_layers: int
    holds: tuple[str, ...]
    params_per_rank: int
    expert_params_per_rank: int = 0  # part of params_per_rank
    # Parts of params_per_rank that take no gradient (LoRA's base, a frozen tower): weights only.
    frozen_params_per_rank: float = 0.0
    frozen_expert_params_per_rank: float = 0.0
    adapter_params_per_rank: float = 0.0  # LoRA's, on top of params_per_rank; they train


def _stage_plans(cfg: RunConfig, sizes: ParallelSizes, split: ParameterSplit) -> list[StagePlan]:
    tp, vision_tp = sizes.tensor_parallel, sizes.vision_tensor_parallel
    tied = cfg.model.language.tie_word_embeddings
    stages = []
    stage_layers = stage_plan(cfg.model.language.num_layers, cfg.parallel)
    counts = [stage_layers.rank_layers(rank) for rank in range(sizes.pipeline_parallel)]
    layer_kinds = decoder_layer_kinds(cfg.model.language)
    # parallel.encoder_dp=full: every stage holds an encoder replica, not only the first.
    replicas_everywhere = cfg.parallel.encoder_dp == "full"
    expert_shards = sizes.expert_parallel * sizes.expert_tensor_parallel
    adapters = _adapters(cfg, sizes)
    lora = adapters is not None
    frozen_encoder = (split.vision_model * (lora or cfg.training.freeze_vision)
                      + split.projector * (lora or cfg.training.freeze_projector))
    for index, num_layers in enumerate(counts):
        kinds = rank_layer_types(stage_layers, layer_kinds, index)
        expert_params = split.experts_of(kinds) / expert_shards
        layers_params = split.layers_parameters(kinds)
        holds, params = [], layers_params / tp + expert_params
        frozen, adapter_params = 0.0, num_layers * adapters.per_decoder_layer if lora else 0.0
        encoder_params = 0.0
        if cfg.model.vision is not None and (index == 0 or replicas_everywhere):
            holds += ["vision tower + projector" if index == 0 else "vision tower + projector (replica)"]
            encoder_params = split.vision_and_projector / vision_tp
            params += encoder_params
            frozen += frozen_encoder / vision_tp
            adapter_params += adapters.vision_and_projector if lora else 0.0
        if index == 0:
            holds += ["embeddings"]
            params += split.input_embedding / tp
        if index == len(counts) - 1:
            # A tied head is the embedding itself on one stage, a copy on the last one otherwise.
            head = split.output_head or (split.input_embedding if len(counts) > 1 and tied else 0)
            holds += ["LM head"] if head or not tied else ["LM head (tied)"]
            params += head / tp
            if split.mtp:
                # The multi-token-prediction layers, and their copy of the embedding on a stage of its own.
                holds += ["MTP layers" + (" + embedding copy" if len(counts) > 1 else "")]
                mtp_experts = split.mtp_experts / expert_shards
                expert_params += mtp_experts
                params += (split.mtp + (split.input_embedding if len(counts) > 1 else 0)) / tp + mtp_experts
        warmup = _dense_warmup_indexers(cfg.model.language)
        language_frozen = lora or cfg.training.freeze_language or warmup is not None
        if lora:  # the whole base is frozen
            frozen = params - expert_params
        elif warmup is not None:  # sparse attention's dense warm-up: everything but the indexers (replicated on TP)
            mtp_layers = cfg.model.language.mtp_num_layers if split.mtp and index == len(counts) - 1 else 0
            frozen = params - expert_params - warmup * (num_layers + mtp_layers)
        elif language_frozen:  # everything but the encoder's parts
            frozen += params - expert_params - encoder_params
        ranges = tuple((stage_layers.first_layer(index, chunk), stage_layers.first_layer(index, chunk) + count - 1)
                       for chunk, count in enumerate(stage_layers.layers[index]) if count)
        stages.append(StagePlan(index, ranges, num_layers, tuple(holds), round(params), round(expert_params),
                                frozen_params_per_rank=frozen,
                                frozen_expert_params_per_rank=expert_params if language_frozen else 0.0,
                                adapter_params_per_rank=adapter_params))
    return stages


def _dense_warmup_indexers(lang: LanguageConfig) -> float | None:
    """Parameters of one layer's indexer where sparse attention's dense warm-up trains them alone, else None."""
    if lang.sparse_attention is None or lang.sparse_attention.stage != "dense_warmup":
        return None
    return SparseLatentAttention.parameters(lang) - LatentAttention.parameters(lang)


def _adapters(cfg: RunConfig, sizes: ParallelSizes) -> AdapterParameters | None:
    """One rank's LoRA adapters (``lora.rank`` > 0), else None."""
    if not cfg.lora.rank:
        return None
    return adapter_parameters(cfg.model, cfg.lora, tensor_parallel=sizes.tensor_parallel,
                              vision_tensor_parallel=sizes.vision_tensor_parallel,
                              expert_parallel=sizes.expert_parallel)


def training_bytes_per_param(precision: str, optimizer: str, distributed_optimizer: bool,
                             data_parallel: int) -> float:
    """Weights + gradients + optimizer state bytes per parameter, megatron-core's accounting.

    Gradients accumulate in fp32 in both precisions; bf16 adds an fp32 master copy of the
    weights; Adam keeps two fp32 moments, plain SGD none. The distributed optimizer shards the
    master copy and the moments over ``data_parallel`` ranks: DP x CP for the dense part
    (``ParallelSizes.data_context_parallel``), the expert data-parallel ranks for routed experts.
    """
    weights = 2 if precision == "bf16" else 4
    grads = 4
    master = 4 if precision == "bf16" else 0
    moments = 8 if optimizer == "adam" else 0
    sharded = (master + moments) / (data_parallel if distributed_optimizer else 1)
    return weights + grads + sharded


@dataclass(frozen=True)
class ParallelPlan:
    sizes: ParallelSizes
    global_batch_size: int
    micro_batches_per_rank: int
    seq_len: int
    split: ParameterSplit
    stages: list[StagePlan]
    bytes_per_param: float
    precision: str
    optimizer: str
    distributed_optimizer: bool
    has_vision: bool = True
    # Routed experts' bytes per parameter: their optimizer state is sharded over the expert
    # data-parallel ranks, not DP.
    expert_bytes_per_param: float = 0.0
    balancing: str = "off"  # what balance.* does at this layout (balancing_text)
    # Per rank, bytes of vision-encoder activations saved for backward by encoder mode
    # (encoder_activation_bytes); None without an online encoder.
    encoder_activations: dict | None = None
    encoder_mode: str = "none"  # the run's: parallel.encoder_dp, "full, recompute" with encoder_full_recompute
    weight_bytes: float = 2.0  # bytes of one frozen weight (no gradient, no optimizer state)
    trainable_text: str = ""  # what trains (trainable_parameters_text)
    # LoRA runs: the same run's memory per rank with every parameter trained (lora.rank=0).
    full_training_bytes: float | None = None
    context_text: str = ""  # how CP splits a row at this layout (context_parallel_text); "" at CP 1
    parts_text: str = ""  # what the model is composed of (composition_text); "" for a text-only model

    @property
    def max_params_per_rank(self) -> int:
        return max(stage.params_per_rank for stage in self.stages)

    def stage_memory_bytes(self, stage: StagePlan) -> float:
        dense = stage.params_per_rank - stage.expert_params_per_rank - stage.frozen_params_per_rank
        experts = stage.expert_params_per_rank - stage.frozen_expert_params_per_rank
        frozen = stage.frozen_params_per_rank + stage.frozen_expert_params_per_rank
        return ((dense + stage.adapter_params_per_rank) * self.bytes_per_param
                + experts * self.expert_bytes_per_param + frozen * self.weight_bytes)

    @property
    def memory_per_rank_bytes(self) -> float:
        return max(self.stage_memory_bytes(stage) for stage in self.stages)

    @property
    def has_experts(self) -> bool:
        return self.split.experts_per_decoder_layer > 0


def build_parallel_plan(cfg: RunConfig) -> ParallelPlan:
    """The plan for ``cfg`` at ``cfg.parallel.world_size`` (validated configs only); ConfigError
    where the model family's own layout rule refuses it."""
    check_family_layout(cfg)
    sizes = derive_parallel_sizes(cfg.parallel)
    split = split_parameters(cfg.model)
    # The run's choice (null = on at DP x CP > 1), as train.runner.wrap_for_training makes it.
    distributed = data_parallel_settings(cfg.parallel, sizes.data_context_parallel).distributed_optimizer
    return ParallelPlan(
        sizes=sizes,
        global_batch_size=cfg.training.global_batch_size,
        micro_batches_per_rank=cfg.training.global_batch_size // sizes.data_parallel,
        seq_len=cfg.data.seq_len,
        split=split,
        stages=_stage_plans(cfg, sizes, split),
        bytes_per_param=training_bytes_per_param(
            cfg.training.precision, cfg.optimizer.name, distributed,
            sizes.data_context_parallel),
        expert_bytes_per_param=training_bytes_per_param(
            cfg.training.precision, cfg.optimizer.name, distributed,
            sizes.expert_data_parallel),
        precision=cfg.training.precision,
        optimizer=cfg.optimizer.name,
        distributed_optimizer=distributed,
        has_vision=cfg.model.vision is not None,
        balancing=balancing_text(cfg, sizes),
        encoder_activations=encoder_activation_bytes(cfg, sizes),
        encoder_mode=_encoder_mode(cfg),
        weight_bytes=2 if cfg.training.precision == "bf16" else 4,
        trainable_text=trainable_parameters_text(cfg, split),
        full_training_bytes=(build_parallel_plan(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0)))
                             .memory_per_rank_bytes if cfg.lora.rank else None),
        context_text=context_parallel_text(cfg, sizes),
        parts_text=composition_text(cfg, split),
    )


def composition_text(cfg: RunConfig, split: ParameterSplit) -> str:
    """The parts a VLM is composed of (``models.parts``) with their parameters; "" for a text-only model."""
    family = get_family(cfg.model.family)
    if not family.has_vision:
        return ""
    tower = parts.tower(family.tower(cfg.model))
    projector = cfg.model.projector.arch or tower.projectors[0]
    language = split.total - split.vision_model - split.projector
    return (f"vision tower {tower.arch} {human_count(split.vision_model)} + projector {projector} "
            f"{human_count(split.projector)} + language model {human_count(language)}")


def context_parallel_text(cfg: RunConfig, sizes: ParallelSizes) -> str:
    """How CP splits a row at this layout and who encodes its media; "" at CP 1."""
    cp = sizes.context_parallel
    if cp == 1:
        return ""
    text = (f"CP{cp}: each {cfg.data.seq_len}-token row split over {cp} ranks, {cfg.data.seq_len // cp} tokens "
            f"per rank (every sample padded to a multiple of {sample_multiple(cfg.data, cfg.parallel)})")
    if cfg.model.vision is None or cfg.data.vision_embeddings is not None:
        return text
    if encoder_shared_over_context(cfg.parallel):
        return text + "; the row's images and videos divided over the CP ranks (parallel.encoder_cp)"
    why = "encoder_dp=full divides steps instead" if cfg.parallel.encoder_cp else "parallel.encoder_cp=false"
    return text + f"; every CP rank encodes all of the row's images and videos ({why})"


def trainable_parameters_text(cfg: RunConfig, split: ParameterSplit) -> str:
    """What the run trains: every parameter, all but a frozen tower, LoRA's adapters alone, or sparse attention's
    indexers alone (its dense warm-up)."""
    if cfg.lora.rank:
        lora = cfg.lora
        total = adapter_parameters(cfg.model, lora, tensor_parallel=1, vision_tensor_parallel=1,
                                   expert_parallel=1).total
        experts = " and the routed experts' fc1, fc2" if lora.experts else ""
        return (f"{human_count(total)} LoRA adapter parameters ({100 * total / split.total:.2f}% of "
                f"{human_count(split.total)}): rank {lora.rank}, alpha {lora.alpha:g} on "
                f"{'/'.join(lora.targets)} {', '.join(lora.modules)}{experts}; the base is frozen")
    training, lang = cfg.training, cfg.model.language
    warmup = _dense_warmup_indexers(lang)
    if warmup is not None:
        indexers = warmup * (lang.num_layers + lang.mtp_num_layers)
        return f"{human_count(indexers)} of {human_count(split.total)} (sparse_attention.stage=dense_warmup: the indexers)"
    language = split.total - split.vision_model - split.projector
    frozen = (split.vision_model * training.freeze_vision + split.projector * training.freeze_projector
              + language * training.freeze_language)
    if not frozen:
        return f"all {human_count(split.total)}"
    parts = [name for name, on in (("vision tower", training.freeze_vision), ("projector", training.freeze_projector),
                                   ("language model", training.freeze_language)) if on]
    return f"{human_count(split.total - frozen)} of {human_count(split.total)} ({' and '.join(parts)} frozen)"


def _encoder_mode(cfg: RunConfig) -> str:
    full_recompute = cfg.parallel.encoder_dp == "full" and cfg.parallel.encoder_full_recompute
    return "full, recompute" if full_recompute else cfg.parallel.encoder_dp


def encoder_activation_bytes(cfg: RunConfig, sizes: ParallelSizes) -> dict[str, float] | None:
    """Per rank, the vision encoder's activations saved for backward at their peak, for each way of
    running it (``none``, ``tp``, ``full``, ``full, recompute``); None without an online encoder.

    An estimate for planning, at the worst case of a micro-batch whose every token is an image
    token (``seq_len x merge^2`` patches): per patch and block, the values its blocks save
    (``TowerPart.saved_values``: 4 h whole, the norms' and linears' inputs, and 4 h + 3 i or 2 i split over
    the encoder's TP: q, k, v, the attention output, and a gated MLP's gate, up and product or a plain one's
    up projection and activation). ``none`` / ``tp``: the micro-batches a
    first stage holds at once (PP under 1F1B; ``tp`` divides each over the TP group); ``full``: a
    rank's share of the step (micro-batches / (TP x PP)) plus the step's gathered features and
    their gradient; ``full, recompute``: one micro-batch's plus those features. Under context
    parallelism with ``parallel.encoder_cp`` the CP ranks divide each row's media in ``none`` and
    ``tp``; ``full`` divides whole steps over TP x PP, the same on every CP rank. With
    ``training.recompute_activations`` (both towers) a block keeps its input only, h per patch, and
    one block's values exist at a time in the backward.
    """
    vision = cfg.model.vision
    if vision is None or cfg.data.vision_embeddings is not None:
        return None
    value_bytes = _value_bytes(cfg)
    merge = cfg.model.projector.spatial_merge_size ** 2
    patches = cfg.data.seq_len * merge  # one micro-batch of image tokens only

    tower = parts.tower(get_family(cfg.model.family).tower(cfg.model))

    def per_patch(tp: int) -> float:
        block = value_bytes * tower.saved_values(cfg.model, tp)  # the tower's own (its MLP gated or plain)
        if cfg.training.recompute_activations:
            return vision.depth * value_bytes * vision.hidden_size + block
        return vision.depth * block

    micro_batches = cfg.training.global_batch_size // sizes.data_parallel
    in_flight = min(sizes.pipeline_parallel, micro_batches)
    group = sizes.tensor_parallel * sizes.pipeline_parallel
    cp_share = sizes.context_parallel if cfg.parallel.encoder_cp else 1
    features = micro_batches * patches / merge * cfg.model.projector.out_hidden_size * value_bytes * 2
    return {"none": in_flight * patches / cp_share * per_patch(sizes.vision_tensor_parallel),
            "tp": in_flight * patches / (sizes.tensor_parallel * cp_share) * per_patch(1),
            "full": micro_batches * patches / group * per_patch(1) + features,
            "full, recompute": patches * per_patch(1) + features}


def _value_bytes(cfg: RunConfig) -> int:
    return 4 if cfg.training.precision == "fp32" else 2


def decoder_activation_bytes(cfg: RunConfig, sizes: ParallelSizes) -> float:
    """Per rank, the decoder layers' activations saved for backward at their peak, for a rank's
    share of a row: seq_len / CP tokens.

    The first stage holds the most: min(PP, micro-batches) micro-batches in flight under 1F1B, each
    over its layers (the most any rank holds); the interleaved schedule's warm-up keeps
    2 (PP - 1) + (VP - 1) PP + 1 chunks in flight on it, PP + (PP - 1) / VP micro-batches' worth. Per token and layer, the values a pre-norm block saves (as
    ``encoder_activation_bytes`` counts them): 4 h for the two norms' inputs and the linears they
    feed (split over TP under sequence parallelism, whole otherwise), and, split over TP, the token
    mixer's and the MLP's, each by its kind (``layer_costs``' ``saved_values_per_token``: a full-attention
    layer's q, k, v and attention output, a linear-attention layer's Gated DeltaNet values, none of them
    growing with the sample's length, and under CP the keys each local chunk sees; the MLP's or the routed
    experts'). A hybrid decoder's busiest rank is the one whose layers save
    the most. With ``training.recompute_activations`` every layer keeps its input only, and one layer's
    values exist at a time in the backward.
    """
    language = cfg.model.language
    value_bytes = _value_bytes(cfg)
    tokens = cfg.data.seq_len / sizes.context_parallel
    micro_batches = cfg.training.global_batch_size // sizes.data_parallel
    stages = stage_plan(language.num_layers, cfg.parallel)
    pipeline, virtual = sizes.pipeline_parallel, stages.virtual
    in_flight = min(pipeline if virtual == 1 else pipeline + (pipeline - 1) / virtual, micro_batches)
    tp = sizes.tensor_parallel
    norm_inputs = language.hidden_size / (tp if cfg.parallel.sequence_parallel else 1)  # one of the four
    def per_layer(kind: str) -> float:
        mixer = token_mixer(language, _mixer(kind)).saved_values_per_token(
            language, tp, cp=sizes.context_parallel)
        values = mlp(language, sparse=not kind.endswith(DENSE_MLP)).saved_values_per_token(
            language, tp, sizes.expert_tensor_parallel)
        return value_bytes * (4 * norm_inputs + mixer + values)

    layer_types = decoder_layer_kinds(language)
    ranks = [rank_layer_types(stages, layer_types, rank) for rank in range(pipeline)]
    if cfg.training.recompute_activations:
        inputs = in_flight * max(len(kinds) for kinds in ranks) * value_bytes * norm_inputs
        return tokens * (inputs + max(per_layer(kind) for kind in set(layer_types)))
    return tokens * in_flight * max(sum(per_layer(kind) for kind in kinds) for kinds in ranks)


def lm_head_activation_bytes(cfg: RunConfig, sizes: ParallelSizes, *, whole: bool = False) -> float:
    """Per rank, the LM head's logits for a rank's share of a row at worst: every token a loss token
    (the head runs on those only), each a vocabulary / TP row.

    Whole (``training.loss_chunk_tokens=0``, or ``whole``): megatron-core's cross-entropy keeps an fp32
    copy for backward of every head's (the decoder's and each multi-token-prediction layer's, which run on
    every position), and the GEMM writes the last head's in the run's precision beside it. Chunked: one
    chunk of ``training.loss_chunk_tokens`` tokens at a time, its fp32 logits and the GEMM's copy, whatever
    the heads (``models.decoder.chunked_loss`` keeps one float a token for backward)."""
    value_bytes = _value_bytes(cfg)
    tokens = cfg.data.seq_len / sizes.context_parallel
    vocabulary = cfg.model.language.vocab_size / sizes.tensor_parallel
    gemm_copy = value_bytes if value_bytes < 4 else 0  # a bf16 GEMM's output beside its fp32 cast
    chunk_tokens = cfg.training.loss_chunk_tokens
    if chunk_tokens and not whole:
        return min(tokens, chunk_tokens) * vocabulary * (4 + gemm_copy)
    return tokens * vocabulary * (4 * (1 + cfg.model.language.mtp_num_layers) + gemm_copy)


def activation_bytes(cfg: RunConfig, sizes: ParallelSizes) -> float:
    """Per rank, an estimate of a row's activations at their peak: the decoder's plus the larger of
    the vision encoder's (in the run's ``parallel.encoder_dp`` mode, every token an image token) and
    the LM head's (every token a loss token). Image tokens take no loss, so a row's mix of the two
    costs at most the larger; with PP > 1 (the encoder on the first stage, the head on the last) this
    bounds the busiest stage from above."""
    encoder = encoder_activation_bytes(cfg, sizes)
    encoder_bytes = 0.0 if encoder is None else encoder[_encoder_mode(cfg)]
    return decoder_activation_bytes(cfg, sizes) + max(encoder_bytes, lm_head_activation_bytes(cfg, sizes))


def balancing_text(cfg: RunConfig, sizes: ParallelSizes) -> str:
    """DP load balancing at this layout: off, or its mode and where its cost model comes from."""
    balance = cfg.balance
    if not balance.enabled:
        return "off (balance.enabled=false)"
    mode = "exchange" if resolve_read(cfg.data, sizes.data_parallel) == "sharded" else "manifest"
    if balance.cost_model:
        source = f"cost model {balance.cost_model}"
    elif balance.fit_steps:
        first = balance.fit_warmup_steps + 1
        source = (f"cost model fitted online from steps {first}-{first + balance.fit_steps - 1} "
                  f"(token counts until then)")
    else:
        source = "token counts (balance.fit_steps=0)"
    return f"on, {mode} mode over DP{sizes.data_parallel}, {source}"


def human_count(number: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(number) >= scale:
            return f"{number / scale:.2f}{unit}"
    return str(int(number))


def layout_label(sizes: ParallelSizes) -> str:
    """``TP2 x PP1 x DP4``; with context parallelism ``TP2 x CP2 x PP1 x DP2``."""
    context = f" x CP{sizes.context_parallel}" if sizes.context_parallel > 1 else ""
    return f"TP{sizes.tensor_parallel}{context} x PP{sizes.pipeline_parallel} x DP{sizes.data_parallel}"


def _optimizer_shards_label(sizes: ParallelSizes) -> str:
    context = f" x CP{sizes.context_parallel}" if sizes.context_parallel > 1 else ""
    return f"DP{sizes.data_parallel}{context}"


def _memory_note(plan: ParallelPlan) -> str:
    states = "Adam moments" if plan.optimizer == "adam" else "no optimizer state (SGD)"
    master = ", fp32 master weights" if plan.precision == "bf16" else ""
    sharding = (f", master/moments sharded over {_optimizer_shards_label(plan.sizes)}"
                + (f" (experts: expert DP{plan.sizes.expert_data_parallel})" if plan.has_experts else "")
                if plan.distributed_optimizer else "")
    experts = f" (routed experts {plan.expert_bytes_per_param:.2f})" if plan.has_experts else ""
    frozen = (f"; frozen weights {plan.weight_bytes:g} bytes/param (no grads or optimizer state)"
              if any(stage.frozen_params_per_rank or stage.frozen_expert_params_per_rank for stage in plan.stages)
              else "")
    return (f"{plan.precision} weights, fp32 grads{master}, {states}{sharding}; "
            f"{plan.bytes_per_param:.2f} bytes/param{experts}{frozen}; activations: the context parallel table below")


def _encoder_activation_text(plan: ParallelPlan) -> str:
    modes = ", ".join(f"{mode} ~{size / GIB:.1f} GiB" + (" (this run)" if mode == plan.encoder_mode else "")
                      for mode, size in plan.encoder_activations.items())
    return (f"per rank at most, by parallel.encoder_dp: {modes} (an estimate: every token of a "
            f"micro-batch an image token; full, recompute = parallel.encoder_full_recompute=true)")


def _expert_rows(plan: ParallelPlan) -> list[tuple[str, str]]:
    if not plan.has_experts:
        return []
    sizes = plan.sizes
    return [("expert parallel", f"EP{sizes.expert_parallel} x expert TP{sizes.expert_tensor_parallel} x expert "
                                f"DP{sizes.expert_data_parallel}: each rank holds 1/{sizes.expert_parallel} of "
                                f"every MoE layer's experts, tokens reach them by all-to-all")]


def _data_parallel_text(sizes: ParallelSizes) -> str:
    if sizes.context_parallel == 1:
        return f"{sizes.data_parallel} = {sizes.world_size} / ({sizes.tensor_parallel} x {sizes.pipeline_parallel})"
    return (f"{sizes.data_parallel} = {sizes.world_size} / (TP{sizes.tensor_parallel} x PP{sizes.pipeline_parallel} "
            f"x CP{sizes.context_parallel})")


def format_parallel_plan(plan: ParallelPlan) -> str:
    sizes = plan.sizes
    rows = [
        ("world size", f"{sizes.world_size} process{'es' if sizes.world_size > 1 else ''} = "
                       f"{layout_label(sizes)}"),
        ("tensor parallel", f"{sizes.tensor_parallel}" + (
            f" (vision encoder: {sizes.vision_tensor_parallel})" if plan.has_vision else "")),
        ("pipeline parallel", str(sizes.pipeline_parallel)),
        *_expert_rows(plan),
        ("data parallel", _data_parallel_text(sizes)),
        *([("context parallel", plan.context_text)] if plan.context_text else []),
        ("micro-batches", f"{plan.micro_batches_per_rank} per rank per step = global batch "
                          f"{plan.global_batch_size} / DP{sizes.data_parallel}, "
                          f"one {plan.seq_len}-token packed row each"),
        ("tokens per step", f"{plan.global_batch_size * plan.seq_len:,}"),
        ("parameters", f"{human_count(plan.split.total)} total ({plan.split.total:,})"
                       + (f", {human_count(plan.split.active)} active per token" if plan.has_experts else "")),
        *([("composed of", plan.parts_text)] if plan.parts_text else []),
    ]
    for stage in plan.stages:
        layers = "layers " + ", ".join(f"{first}-{last}" if last > first else str(first)
                                       for first, last in stage.layer_ranges)
        rows.append((f"stage {stage.index}", f"{layers} ({stage.num_layers})"
                     + "".join(f" + {part}" for part in stage.holds)
                     + f": {human_count(stage.params_per_rank)} params per rank"))
    rows.append(("trainable", plan.trainable_text))
    rows.append(("DP balancing", plan.balancing))
    full = ("" if plan.full_training_bytes is None
            else f"; full fine-tuning at this layout: ~{plan.full_training_bytes / GIB:.1f} GiB")
    rows.append(("memory per rank", f"~{plan.memory_per_rank_bytes / GIB:.1f} GiB for "
                 f"weights + grads + optimizer state on the busiest stage{full} ({_memory_note(plan)})"))
    if plan.encoder_activations is not None:
        rows.append(("encoder activations", _encoder_activation_text(plan)))
    width = max(len(label) for label, _ in rows)
    return "parallel plan\n" + "\n".join(f"  {label:<{width}}  {text}" for label, text in rows)
