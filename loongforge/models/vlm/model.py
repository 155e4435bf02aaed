"""A vision-language model composed of parts: a vision encoder (tower + projector, ``vlm.encoder``)
and the shared decoder (``models.decoder``), on megatron-core. Every VLM family is built here.

One pipeline stage holds:

- the vision encoder's children (``vision_model``, ``projector``, and side projectors such as
  DeepStack's), on the first pipeline stage (on every stage with ``parallel.encoder_dp=full``);
  tensor parallel over the vision TP group (``vlm.process_groups``), which may be smaller than the
  language model's;
- ``language_model``: megatron-core's ``GPTModel`` (``LanguageModel``) with the family's rotary
  positions (1-D, M-RoPE, or a rotary module the family gives). It gets ``decoder_input``: text
  embeddings with the merged features written over the image/video placeholder tokens; and, when the
  encoder gives side feature sets, those sets as the block's ``context``, added after the first
  decoder layers (``vlm.deepstack``).

How the encoder's work is divided is the same for every family: each rank encodes its micro-batch's
media (``encoder_dp=none``), the TP and/or CP group shares each micro-batch's media
(``encoder_dp=tp``, ``parallel.encoder_cp``: ``models.vlm.encoder_share``), or the model-parallel group
shares each step's (``encoder_dp=full``: ``models.vlm.encoder_full``). Which of these a family allows
is its layout rule (``ModelFamily.layout``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from loongforge.config.layout import vision_tensor_parallel_size
from loongforge.config.schema import ModelConfig, ParallelConfig, TrainingConfig
from loongforge.models.decoder import configs as decoder_configs
from loongforge.models.decoder.build import (
    BuildContext,
    build_context,
    build_language_model,
    check_inputs,
    placeholder_count,
)
from loongforge.models.vlm.encoder_full import StepEncoding
from loongforge.models.vlm.encoder_share import (
    SharedEncoding,
    SharingGroups,
    sharing_groups,
)
from loongforge.models.decoder.moe_balance import routing_padding_mask
from loongforge.models.media import MediaBatch
from loongforge.models.parts import TowerPart
from loongforge.models.vlm.vision_common import (
    held_features,
    optional_cat,
    scatter_features,
    vision_pg_collection,
    written_over,
)
from loongforge.models.vlm import deepstack
from loongforge.models.vlm.encoder import (
    BuildVisionEncoder,
    EncoderBuild,
    VisionEncoder,
)
from loongforge.models.vlm.process_groups import (
    build_vision_tp_group,
    keep_qk_norms_from_tp_sum,
    mark_tp_duplicates,
)
from loongforge.parallel.context_parallel import ContextShard
from loongforge.parallel.encoder_dp import (
    mark_encoder_replicas,
    mark_pipeline_replicas,
    touch_with_zero,
)
from loongforge.parallel.media_assign import VisionCost


class VisionLanguageModel(MegatronModule):
    """One pipeline stage of a VLM. Build it with ``build_vlm`` (a family's ``build_model`` does)."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        language_config: TransformerConfig,
        language_pgs: ProcessGroupCollection,
        context: BuildContext,
        encoder: Optional[VisionEncoder],
        encoder_type: type[VisionEncoder],
        with_encoder: bool,
        side_sets: int,
        merge_unit: int,
        vision_tp: int,
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int],
        rope: str,
        rotary: Optional[torch.nn.Module] = None,
        routing_token_ids: tuple[int, ...] = (),
        loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens,
    ):
        """``encoder``: this stage's vision encoder (an ``encoder_type``), None where it holds none (a
        later stage, or a model trained on ``loongforge encode``'s stored features, ``with_encoder``
        false); its parts then read None. ``side_sets``: the encoder's side
        feature sets (DeepStack), also when it is not built here (stored features carry them);
        ``merge_unit``: patches per merged token, likewise.
        ``rope``: the decoder's positions, ``"mrope"`` (three rows) or ``"rope"`` (the first row);
        ``rotary``: a rotary module the family puts in the decoder's place (Qwen3-VL's interleaved
        M-RoPE), called as megatron calls its own."""
        super().__init__(config=language_config)
        self.model_cfg = model_cfg
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = model_cfg.language.tie_word_embeddings
        self.side_sets = side_sets
        self.rope = rope
        # megatron's pipeline schedules read this: one decoder stack, no separate encoder stages.
        self.model_type = ModelType.encoder_or_decoder
        # The encoder's children become this module's, under their own names (checkpoint keys); the
        # encoder itself is held unregistered, to run them.
        self.__dict__["_encoder"] = encoder  # not a submodule: its children are (below)
        self._encoder_type = encoder_type
        for name in encoder_type.vision_parts + encoder_type.projector_parts:
            if encoder is None:
                setattr(self, name, None)
            else:
                self.add_module(name, getattr(encoder, name))
        self.merge_unit = merge_unit  # patches per placeholder token
        # What each tower is built from, for the run's startup line.
        self.layer_backends = {"vision": context.modules.describe() if with_encoder else "none (stored embeddings)",
                               "language": context.modules.describe()}
        # With a vision TP smaller than the language TP, the towers are replicated across the
        # language TP group in blocks of vision-TP ranks: block k holds replica k of every shard.
        self._vision_tp = vision_tp
        self._vision_replica_block = get_pg_rank(language_pgs.tp) // vision_tp
        # The pipeline stage whose towers are the main replica in checkpoints (encoder_dp=full).
        self._pp_rank = get_pg_rank(language_pgs.pp)
        # parallel.encoder_dp=tp / encoder_cp: the TP and/or CP group divides each micro-batch's media.
        self.shared_encoding: Optional[SharedEncoding] = None
        # parallel.encoder_dp=full: the model-parallel group divides each step's media.
        self.step_encoding: Optional[StepEncoding] = None

        self.language_model = build_language_model(
            model_cfg, language_config, context.modules, language_pgs, pre_process=pre_process,
            post_process=post_process, vp_stage=vp_stage, init_seed=context.init_seed, rope=rope,
            takes_features=True, routing_token_ids=routing_token_ids, loss_chunk_tokens=loss_chunk_tokens)
        if rotary is not None:
            # GPTModel calls rotary_pos_emb(position_ids, mrope_section, cp_group=...): same call.
            self.language_model.rotary_pos_emb = rotary
        if pre_process and side_sets:
            deepstack.install_hooks(self.language_model.decoder.layers, side_sets)

    def towers(self) -> dict[str, list[torch.nn.Module]]:
        """The parts this rank holds, by what ``training.freeze_*`` names them."""
        def held(names: tuple[str, ...]) -> list[torch.nn.Module]:
            return [getattr(self, name) for name in names if getattr(self, name) is not None]

        return {"vision": held(self._encoder_type.vision_parts),
                "projector": held(self._encoder_type.projector_parts),
                "language": [self.language_model]}

    # -- pipeline plumbing (megatron schedules and finalize_model_grads call these) -------------

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return self.language_model.shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self._encoder is None:
            return sharded
        parts = self._encoder_type.vision_parts + self._encoder_type.projector_parts
        towers = tuple(f"{prefix}{name}." for name in parts)
        for key, item in sharded.items():
            if not key.startswith(towers):
                continue
            if self._vision_replica_block:
                item.replica_id = _with_tp_replica_block(item.replica_id, self._vision_replica_block,
                                                         self._vision_tp)
            if self._pp_rank:  # encoder_dp=full: the first stage's towers are saved, these are copies
                item.replica_id = _with_pp_replica(item.replica_id, self._pp_rank)
        return sharded

    # -- parallel.encoder_dp=full: the step's media encoded before the pipeline runs -------------

    def begin_step(self, micro_batches: list[dict]) -> int:
        """Encode this rank's share of the step's media (collective over the model-parallel
        group); returns the bytes held for the step. Without ``encoder_dp=full``: nothing, 0."""
        if self.step_encoding is None:
            return 0
        media = [_rows_and_grids(mb.get("media") or MediaBatch()) for mb in micro_batches]
        return self.step_encoding.begin(self._encoder, media, _device_of(self))

    def finish_step(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """After the pipeline flush: (parameter, gradient of the whole step summed over the
        model-parallel group) for every trainable encoder parameter; [] without ``encoder_dp=full``.
        Collective over the model-parallel group."""
        if self.step_encoding is None or not self.step_encoding.active:
            return []
        trainable = self._trainable_encoder_params()
        return list(zip(trainable, self.step_encoding.finish(trainable)))

    def _trainable_encoder_params(self) -> list[torch.nn.Parameter]:
        return [param for param in self._encoder.parameters() if param.requires_grad]

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        media: Optional[MediaBatch] = None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        context_shard: Optional[ContextShard] = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] fp32 when ``labels`` is given, else logits [b, s, V_padded/tp].

        input_ids [b, s]; position_ids [3, b, s] (M-RoPE t/h/w; a 1-D rope reads the first row);
        labels [b, s] next-token targets, valid ids everywhere (the caller masks); packed_seq_params:
        thd with b == 1 and cu_seqlens over all b*s tokens. ``media`` (``models.media.MediaBatch``): the
        micro-batch's images and videos in placeholder order, as patch rows [P, C*T*p*p] with their grids
        [n, 3]; or, for a model built without the encoder, the encoder's features computed offline
        (``loongforge encode``) with the grids. On later pipeline stages the hidden states come from
        ``set_input_tensor`` instead.

        ``padding_mask`` [b, s] (True on padding) keeps padding out of MoE routing statistics.
        With ``loss_mask`` [b, s] as well, the LM head runs only where the mask is non-zero and the
        loss is zero elsewhere (same gradients, much less work on a large vocabulary).

        ``context_shard``: under context parallelism the per-token inputs (and the output) are this
        CP rank's s / CP tokens of the row; positions and cu_seqlens stay the whole row's, and the
        row's media are encoded whole, each CP rank writing the features of its own placeholders.
        """
        check_inputs(input_ids, position_ids, packed_seq_params, context_shard)
        decoder_input, context = None, None
        if self.pre_process:
            decoder_input, context = self.embed(input_ids, media or MediaBatch(), context_shard=context_shard)
        return self.language_model(
            input_ids=input_ids,
            position_ids=position_ids if self.rope == "mrope" else position_ids[0],
            attention_mask=None,
            decoder_input=decoder_input,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            # The caller's decoder_input (or a later stage's hidden states): cut here under SP.
            padding_mask=routing_padding_mask(padding_mask, self.language_model.config,
                                              scattered_by_gpt_model=False),
            extra_block_kwargs=None if context is None else {"context": context},
        )

    def embed(
        self,
        input_ids: torch.Tensor,
        media: MediaBatch,
        context_shard: Optional[ContextShard] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(text embeddings with the merged features over their placeholders [s, b, h], the side
        feature sets as the block's context [s, b, k, h], or None without side sets or media); both
        [s/tp, ...] under sequence parallelism. ``context_shard``: ``input_ids`` are this CP rank's
        tokens; the features are the row's."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        tokens = self.model_cfg.tokens
        token_ids = (tokens.image_token_id, tokens.video_token_id)
        row_ids = input_ids if context_shard is None else context_shard.row_input_ids
        image_rows = self._encoder_type.feature_rows(self.model_cfg, media.images, self.merge_unit)
        counts = [placeholder_count(row_ids, tokens.image_token_id, media.grids("image"), "image", self.merge_unit,
                                    num_features=image_rows),
                  placeholder_count(row_ids, tokens.video_token_id, media.grids("video"), "video", self.merge_unit)]
        features = self._features(media)
        context = None
        if features is not None:
            features = features.to(embeddings.dtype)  # [n, (1 + k) h]
            merged, *side = features.chunk(1 + self.side_sets, dim=-1)
            for token_id, part in zip(token_ids, merged.split(counts)):
                embeddings = scatter_features(embeddings, input_ids, token_id,
                                              held_features(part, token_id, context_shard))
            embeddings = written_over(embeddings, features, context_shard)
            if side:
                parts = [f.split(counts) for f in side]  # [k][image, video]
                per_token = [(token_id, [held_features(p[kind], token_id, context_shard) for p in parts])
                             for kind, token_id in enumerate(token_ids) if counts[kind]]
                context = deepstack.dense_context(input_ids, per_token, tuple(embeddings.shape))
        elif self._encoder is not None and self.step_encoding is None:
            # No media in this micro-batch: the encoder still reports a zero gradient to the DDP.
            # (encoder_dp=full reports the encoder's gradients once per step, after the flush.)
            embeddings = touch_with_zero(embeddings, self._trainable_encoder_params())
        if self.config.sequence_parallel:
            group = self.language_model.pg_collection.tp
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=group)
            if context is not None:
                context = tensor_parallel.scatter_to_sequence_parallel_region(context, group=group)
        return embeddings, context

    def _features(self, media: MediaBatch) -> Optional[torch.Tensor]:
        """Features [n, width] of the micro-batch's images then videos; None without any: the stored ones
        for a model built without the encoder, else encoded (by whole image sets where the encoder reads
        more of an image than its rows and grid)."""
        stored = optional_cat(media.features("image"), media.features("video"))
        if self._encoder is None:
            if media.rows("image") is not None or media.rows("video") is not None:
                raise ValueError("this model was built without the vision encoder (data.vision_embeddings): "
                                 "give the media's stored features, not pixels")
            return stored
        if stored is not None:
            raise ValueError("stored image/video features given to a model that runs its own encoder")
        if self._encoder_type.reads_items:
            return self._item_features(media)
        # Images and videos go through the tower together: attention never crosses an image or a frame,
        # so this equals two separate calls and costs one.
        return self._media_features(*_rows_and_grids(media))

    def _media_features(self, pixels: Optional[torch.Tensor],
                        grid_thw: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Features [P/m^2, width] of the micro-batch's images and videos: the step's (encoder_dp=full), or
        encoded here."""
        if self.step_encoding is not None and self.step_encoding.active:
            # encoder_dp=full: every micro-batch, with media or not, takes its turn in the step's
            # features (outside a training step a full replica encodes here, as with none).
            features = self.step_encoding.take(grid_thw)
            return features if features.shape[0] else None
        return None if pixels is None else self._encode(pixels, grid_thw)

    def _item_features(self, media: MediaBatch) -> Optional[torch.Tensor]:
        """Features of the micro-batch's images from an encoder that reads whole items."""
        if media.videos is not None:
            raise ValueError(f"{self._encoder_type.__name__} reads each image whole: it takes images, not videos")
        return None if media.images is None else self._encoder.encode_images(media.images)

    def _encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Features [P/m^2, width] of every image and video, encoded here or shared out over the
        TP and/or CP group."""
        if self.shared_encoding is None:
            return self._encoder(pixels, grid_thw)
        return self.shared_encoding(self._encoder, self._trainable_encoder_params(), pixels, grid_thw)


def _with_tp_replica_block(replica_id, block: int, vision_tp: int):
    """Shift the TP part of a megatron replica id (an int or (pp, tp, dp)) past the replica blocks
    before this one, so that exactly one rank owns (replica 0) each vision shard."""
    if isinstance(replica_id, tuple):
        return (replica_id[0], replica_id[1] + block * vision_tp, *replica_id[2:])
    return replica_id + block * vision_tp


def _with_pp_replica(replica_id, pp_rank: int):
    """A replica id (an int or (pp, tp, dp)) marked as pipeline stage ``pp_rank``'s copy: megatron
    saves a tensor from the rank whose replica id is all zeros, the first stage's here."""
    if isinstance(replica_id, tuple):
        return (pp_rank, *replica_id[1:])
    return (pp_rank, replica_id)


def _rows_and_grids(media: MediaBatch) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(patch rows [P, D], grids [n, 3]) of the batch's images then videos, as a tower reads them together
    (None, None without any)."""
    return (optional_cat(media.rows("image"), media.rows("video")),
            optional_cat(media.grids("image"), media.grids("video")))


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def build_vlm(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    tower: TowerPart,
    *,
    side_sets: int,
    merge_unit: int,
    build_encoder: Optional[BuildVisionEncoder] = None,
    params_dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    device: torch.device | str,
    vp_stage: Optional[int] = None,
    recompute_activations: bool = False,
    init_seed: Optional[int] = None,
    vision_cost: Optional[Callable[[], VisionCost]] = None,
    with_encoder: bool = True,
    rope: str = "mrope",
    rotary: Optional[Callable[[], torch.nn.Module]] = None,
    rotary_interleaved: bool = False,
    routing_token_ids: tuple[int, ...] = (),
    loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens,
) -> VisionLanguageModel:
    """This rank's pipeline stage of a VLM whose vision side is ``tower``'s encoder, built by
    ``build_encoder`` (default the encoder type's ``build``); ``side_sets``: its side feature sets,
    ``merge_unit``: its patches per merged token (both known without building it: stored features
    have them too). Needs megatron's
    parallel state initialised to match ``parallel_cfg``. Collective (the vision TP groups): every
    rank calls it.

    ``recompute_activations``: full activation recompute in the encoder and the decoder.
    ``init_seed``: the seed of the initial weights (default: the seed torch's CPU generator was last
    seeded with, ``torch.initial_seed()``); the same seed gives the same full model at every TP, PP
    and vision-TP layout when weights are initialised on the CPU (``models.layers.initialization``).
    ``vision_cost``: the current cost coefficients that divide each micro-batch's (or step's) media
    over the sharing group (the run's cost model); default P^2 + P.
    ``with_encoder=False``: no vision encoder (training on ``loongforge encode``'s stored features,
    passed to forward as ``image_embeds`` / ``video_embeds``). ``rotary``: makes the decoder's rotary
    module where the family's differs from megatron's (``rope``); ``rotary_interleaved``: it gives the
    angles of adjacent channel pairs. ``routing_token_ids``: the ids a decoder with modality-isolated
    experts routes to its vision experts (``decoder.modality_moe``). ``loss_chunk_tokens``: the LM head's loss tokens at a time
    (``training.loss_chunk_tokens``; 0: the whole logits)."""
    context = build_context(model_cfg, parallel_cfg, params_dtype=params_dtype, device=device, init_seed=init_seed)
    language_pgs = context.pgs
    encoder_type = tower.encoder_type()
    vision_tp = vision_tensor_parallel_size(parallel_cfg)
    vision_tp_group = build_vision_tp_group(language_pgs.tp, vision_tp)
    language_config = decoder_configs.language_config(model_cfg.language, parallel_cfg, params_dtype,
                                                      context.on_cpu, recompute_layers=recompute_activations,
                                                      rotary_interleaved=rotary_interleaved)
    if side_sets:
        deepstack.check_pipeline(language_config, side_sets)
    # encoder_dp=full: one replica per pipeline rank, on its first chunk (virtual stage 0).
    encoder_here = with_encoder and (pre_process or (parallel_cfg.encoder_dp == "full" and not vp_stage))
    encoder = None
    if encoder_here:
        encoder = (build_encoder or encoder_type.build)(EncoderBuild(
            model_cfg=model_cfg, vision_tp=vision_tp, tp_group=vision_tp_group,
            pgs=vision_pg_collection(vision_tp_group, language_pgs, context.encoder_cp), modules=context.modules,
            params_dtype=params_dtype, on_cpu=context.on_cpu, recompute=recompute_activations,
            init_seed=context.init_seed))
    model = VisionLanguageModel(
        model_cfg=model_cfg, language_config=language_config, language_pgs=language_pgs, context=context,
        encoder=encoder, encoder_type=encoder_type, with_encoder=with_encoder, side_sets=side_sets,
        merge_unit=merge_unit,
        vision_tp=vision_tp, pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage, rope=rope, rotary=None if rotary is None else rotary(),
        routing_token_ids=routing_token_ids, loss_chunk_tokens=loss_chunk_tokens)
    if encoder is not None:
        mark_tp_duplicates(encoder, vision_tp=vision_tp, replica_block=model._vision_replica_block)
        keep_qk_norms_from_tp_sum(encoder, vision_tp=vision_tp, decoder_qk_norms=language_config.qk_layernorm)
        sharing = sharing_groups(parallel_cfg, language_pgs)
        if encoder_type.reads_items and (sharing is not None or parallel_cfg.encoder_dp == "full"):
            raise ValueError(f"{encoder_type.__name__} reads each image whole (its size or facts) and is not "
                             "shared: set parallel.encoder_dp=none and parallel.encoder_cp=false")
        if sharing is not None:
            _share_encoder(model, sharing, language_pgs.tp, vision_tp=vision_tp, dtype=params_dtype,
                           vision_cost=vision_cost or VisionCost)
        if parallel_cfg.encoder_dp == "full":  # this rank's first chunk: its replica
            _encode_per_step(model, language_pgs, vision_tp=vision_tp, dtype=params_dtype,
                             vision_cost=vision_cost or VisionCost, recompute=parallel_cfg.encoder_full_recompute)
    return model.to(context.device)


def _share_encoder(model: VisionLanguageModel, sharing: SharingGroups, tp_group, *, vision_tp: int,
                   dtype: torch.dtype, vision_cost: Callable[[], VisionCost]) -> None:
    """``parallel.encoder_dp=tp`` and/or ``encoder_cp``: the sharing group's ranks each encode a
    share of the media (``models.vlm.encoder_share``). TP sharing sums the encoder's gradients over the
    TP group (``parallel.encoder_dp``); the grad norm still counts the encoder once: after the sum
    every TP rank holds the same gradient, and ``mark_tp_duplicates`` already counts a vision-TP-1
    encoder on TP rank 0 only. CP sharing needs no more: the data-parallel reduction spans CP."""
    if sharing.tp_shares and vision_tp != 1:
        raise ValueError(f"parallel.encoder_dp=tp needs vision TP 1 (a whole encoder on every TP "
                         f"rank), got {vision_tp}")
    model.shared_encoding = SharedEncoding(
        sharing.group, merge_unit=model.merge_unit, width=model._encoder.width, dtype=dtype,
        vision_cost=vision_cost, gradient_group=sharing.gradient_group)
    if sharing.tp_shares:
        mark_encoder_replicas(model._encoder.parameters(), tp_group)


def _encode_per_step(model: VisionLanguageModel, pgs: ProcessGroupCollection, *, vision_tp: int,
                     dtype: torch.dtype, vision_cost: Callable[[], VisionCost], recompute: bool) -> None:
    """``parallel.encoder_dp=full``: every rank of the model-parallel group (TP x PP) holds an
    encoder replica and encodes a share of each step's media (``encoder_full``). The grad norm counts
    the encoder once: ``mark_tp_duplicates`` counts a vision-TP-1 encoder on TP rank 0 only, and the
    replicas of later pipeline stages are left out (``mark_pipeline_replicas``)."""
    if vision_tp != 1:
        raise ValueError(f"parallel.encoder_dp=full needs vision TP 1 (a whole encoder on every "
                         f"model-parallel rank), got {vision_tp}")
    model.step_encoding = StepEncoding(
        pgs.mp, role=(get_pg_rank(pgs.pp), get_pg_rank(pgs.tp)), receives=model.pre_process,
        merge_unit=model.merge_unit, width=model._encoder.width, dtype=dtype,
        vision_cost=vision_cost, recompute=recompute)
    if model._pp_rank > 0:
        mark_pipeline_replicas(model._encoder.parameters())
