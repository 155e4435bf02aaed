"""Qwen2.5-VL on megatron-core: vision tower -> projector -> M-RoPE GPT decoder.

Mirrors transformers' ``Qwen2_5_VLForConditionalGeneration`` module for module (see
``hf_mapping.py`` for the weight correspondence), with megatron-core doing tensor and pipeline
parallelism:

- ``vision_model`` (first pipeline stage only; every stage with ``parallel.encoder_dp=full``):
  patches -> patch features, TP over the vision group.
- ``projector``: the patch merger, 2x2 patch features -> one language-model token.
- ``language_model``: megatron-core ``GPTModel`` with ``position_embedding_type="mrope"``; it gets
  ``decoder_input`` (text embeddings with the projected image/video features written over the
  image/video placeholder tokens) and 3-D position ids.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import initialization
from loongforge.models.decoder import configs as decoder_configs
from loongforge.models.decoder.build import build_context, check_inputs, placeholder_count
from loongforge.models.decoder.language_model import LanguageModel
from loongforge.models.moe_balance import routing_padding_mask
from loongforge.models.layer_backend import BlockModules
from loongforge.models.qwen2_5_vl import configs
from loongforge.models.qwen2_5_vl.encoder_full import StepEncoding
from loongforge.models.encoder_share import SharedEncoding, SharingGroups, sharing_groups
from loongforge.models.decoder.layer_specs import language_block_spec
from loongforge.models.qwen2_5_vl.layer_specs import vision_layer_spec
from loongforge.models.qwen2_5_vl.process_groups import (
    build_vision_tp_group,
    mark_tp_duplicates,
)
from loongforge.models.qwen2_5_vl.vision import PatchMerger, VisionModel
from loongforge.models.vision_common import (
    held_features,
    optional_cat,
    scatter_features,
    vision_pg_collection,
    written_over,
)
from loongforge.parallel.encoder_dp import mark_encoder_replicas, mark_pipeline_replicas, touch_with_zero
from loongforge.parallel.context_parallel import ContextShard
from loongforge.parallel.media_assign import VisionCost


class Qwen2_5_VLModel(MegatronModule):
    """One pipeline stage of Qwen2.5-VL. Build it with ``build_model``."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        language_config: TransformerConfig,
        vision_config: TransformerConfig,
        projector_config: TransformerConfig,
        modules: BlockModules,
        language_pgs: ProcessGroupCollection,
        vision_tp_group: torch.distributed.ProcessGroup,
        encoder_cp: torch.distributed.ProcessGroup,
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int] = None,
        init_seed: Optional[int] = None,
        encoder_everywhere: bool = False,
        with_encoder: bool = True,
    ):
        """``init_seed``: initial weights keyed by (seed, global name), the same full model at
        every TP/PP layout (``models.initialization``); None: megatron's one running stream.
        ``encoder_everywhere``: build the towers on every pipeline stage (``encoder_dp=full``).
        ``with_encoder=False``: no vision tower or merger; image/video features come with each
        micro-batch (``image_embeds`` / ``video_embeds``, stored by ``loongforge encode``)."""
        super().__init__(config=language_config)
        self.model_cfg = model_cfg
        self.pre_process = pre_process
        self.post_process = post_process
        self.merge_unit = model_cfg.projector.spatial_merge_size**2
        self.share_embeddings_and_output_weights = model_cfg.language.tie_word_embeddings
        # What each tower is built from, for the run's startup line.
        self.layer_backends = {"vision": modules.describe() if with_encoder else "none (stored embeddings)",
                               "language": modules.describe()}
        # megatron's pipeline schedules read this: one decoder stack, no separate encoder stages.
        self.model_type = ModelType.encoder_or_decoder

        self.vision_model: Optional[VisionModel] = None
        self.projector: Optional[PatchMerger] = None
        if with_encoder and (pre_process or encoder_everywhere):
            with initialization.seeded(init_seed, "vision_model"):
                self.vision_model = VisionModel(
                    vision_config,
                    model_cfg,
                    vision_layer_spec(modules),
                    vision_pg_collection(vision_tp_group, language_pgs, encoder_cp),
                )
            with initialization.seeded(init_seed, "projector"):
                self.projector = PatchMerger(projector_config, model_cfg, vision_tp_group, modules)
        # With a vision TP smaller than the language TP, the towers are replicated across the
        # language TP group in blocks of vision-TP ranks: block k holds replica k of every shard.
        self._vision_tp = vision_tp_group.size()
        self._vision_replica_block = get_pg_rank(language_pgs.tp) // self._vision_tp
        # parallel.encoder_dp=tp / encoder_cp: the TP and/or CP group divides each micro-batch's
        # media (build_model).
        self.shared_encoding: Optional[SharedEncoding] = None
        # parallel.encoder_dp=full: the model-parallel group divides each step's media (build_model).
        self.step_encoding: Optional[StepEncoding] = None
        # The pipeline stage whose towers are the main replica in checkpoints (encoder_dp=full).
        self._pp_rank = get_pg_rank(language_pgs.pp)

        lang = model_cfg.language
        tp = language_pgs.tp.size()
        self.language_model = LanguageModel(
            config=language_config,
            transformer_layer_spec=language_block_spec(
                language_config, modules, pp_rank=get_pg_rank(language_pgs.pp), vp_stage=vp_stage,
                init_seed=init_seed,
            ),
            vocab_size=configs.padded_vocab_size(lang.vocab_size, tp),
            true_vocab_size=lang.vocab_size,
            init_seed=init_seed,
            max_sequence_length=lang.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=lang.tie_word_embeddings,
            position_embedding_type="mrope",
            rotary_base=lang.rope_theta,
            # Vision features are written into the embeddings first; we scatter afterwards.
            scatter_embedding_sequence_parallel=False,
            pg_collection=language_pgs,
            vp_stage=vp_stage,
        )

    def towers(self) -> dict[str, list[torch.nn.Module]]:
        """The parts this rank holds, by what ``training.freeze_*`` names them."""
        return {"vision": [m for m in (self.vision_model,) if m is not None],
                "projector": [m for m in (self.projector,) if m is not None],
                "language": [self.language_model]}

    # -- pipeline plumbing (megatron schedules and finalize_model_grads call these) -------------

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return self.language_model.shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.vision_model is None:
            return sharded
        towers = (f"{prefix}vision_model.", f"{prefix}projector.")
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
        media = [(optional_cat(mb.get("pixel_values"), mb.get("pixel_values_videos")),
                  optional_cat(mb.get("image_grid_thw"), mb.get("video_grid_thw"))) for mb in micro_batches]
        return self.step_encoding.begin(lambda p, g: self.projector(self.vision_model(p, g)), media,
                                        _device_of(self))

    def finish_step(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """After the pipeline flush: (parameter, gradient of the whole step summed over the
        model-parallel group) for every trainable encoder parameter; [] without ``encoder_dp=full``.
        Collective over the model-parallel group."""
        if self.step_encoding is None or not self.step_encoding.active:
            return []
        trainable = self._trainable_encoder_params()
        return list(zip(trainable, self.step_encoding.finish(trainable)))

    def _trainable_encoder_params(self) -> list[torch.nn.Parameter]:
        return [param for tower in (self.vision_model, self.projector)
                for param in tower.parameters() if param.requires_grad]

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_thw: Optional[torch.Tensor] = None,
        pixel_values_videos: Optional[torch.Tensor] = None,
        video_grid_thw: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        image_embeds: Optional[torch.Tensor] = None,
        video_embeds: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        context_shard: Optional[ContextShard] = None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] fp32 when ``labels`` is given, else logits [b, s, V_padded/tp].

        ``context_shard``: under context parallelism the per-token inputs (and the output) are this
        CP rank's s / CP tokens of the row; positions and cu_seqlens stay the whole row's, and the
        row's media are encoded whole, each CP rank writing the features of its own placeholders.

        ``padding_mask`` [b, s] (True on padding) keeps padding out of MoE routing statistics.
        With ``loss_mask`` [b, s] as well, the LM head runs only where the mask is non-zero and the
        loss is zero elsewhere (same gradients, much less work on a large vocabulary).

        input_ids [b, s]; position_ids [3, b, s] (M-RoPE t/h/w); labels [b, s] next-token targets,
        valid ids everywhere (the caller masks); packed_seq_params: thd with b == 1 and cu_seqlens
        over all b*s tokens; pixel_values [P, C*T*p*p] with image_grid_thw [n, 3], likewise videos;
        or, for a model built without the encoder, image_embeds [P/m^2, h] (and video_embeds) with
        the grids.
        On later pipeline stages the hidden states come from ``set_input_tensor`` instead.
        """
        check_inputs(input_ids, position_ids, packed_seq_params, context_shard)
        decoder_input = None
        if self.pre_process:
            decoder_input = self.embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                stored=optional_cat(image_embeds, video_embeds), context_shard=context_shard,
            )
        return self.language_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=None,
            decoder_input=decoder_input,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
            # The caller's decoder_input (or a later stage's hidden states): cut here under SP.
            padding_mask=routing_padding_mask(padding_mask, self.language_model.config,
                                              scattered_by_gpt_model=False),
        )

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: Optional[torch.Tensor],
        image_grid_thw: Optional[torch.Tensor],
        pixel_values_videos: Optional[torch.Tensor],
        video_grid_thw: Optional[torch.Tensor],
        stored: Optional[torch.Tensor] = None,
        context_shard: Optional[ContextShard] = None,
    ) -> torch.Tensor:
        """Text embeddings with image/video features in place of their placeholders: [s, b, h].
        ``stored`` [P/m^2, h]: the images' then the videos' features, computed offline.
        ``context_shard``: ``input_ids`` are this CP rank's tokens; the features are the row's."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        tokens = self.model_cfg.tokens
        row_ids = input_ids if context_shard is None else context_shard.row_input_ids
        image_count = self._placeholder_count(row_ids, tokens.image_token_id, image_grid_thw, "image")
        video_count = self._placeholder_count(row_ids, tokens.video_token_id, video_grid_thw, "video")
        # Images and videos go through the tower together: segments never cross an image, so
        # this equals two separate calls and costs one.
        features = self._media_features(optional_cat(pixel_values, pixel_values_videos),
                                        optional_cat(image_grid_thw, video_grid_thw), stored)
        if features is not None:
            features = features.to(embeddings.dtype)
            image_features, video_features = features.split([image_count, video_count])
            for token_id, part in ((tokens.image_token_id, image_features), (tokens.video_token_id, video_features)):
                embeddings = scatter_features(embeddings, input_ids, token_id, held_features(part, token_id, context_shard))
            embeddings = written_over(embeddings, features, context_shard)
        elif self.vision_model is not None and self.step_encoding is None:
            # No media in this micro-batch: the encoder still reports a zero gradient to the DDP.
            # (encoder_dp=full reports the encoder's gradients once per step, after the flush.)
            embeddings = touch_with_zero(embeddings, self._trainable_encoder_params())
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
                embeddings, group=self.language_model.pg_collection.tp
            )
        return embeddings

    def _media_features(self, pixels: Optional[torch.Tensor], grid_thw: Optional[torch.Tensor],
                        stored: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Merged features [P/m^2, h] of the micro-batch's images and videos; None without any:
        the stored ones for a model built without the encoder, the step's (encoder_dp=full), or
        encoded here."""
        if self.vision_model is None:
            if pixels is not None:
                raise ValueError("this model was built without the vision encoder (data.vision_embeddings): "
                                 "pass image_embeds / video_embeds, not pixels")
            return stored
        if stored is not None:
            raise ValueError("image_embeds / video_embeds given to a model that runs its own encoder")
        if self.step_encoding is not None and self.step_encoding.active:
            # encoder_dp=full: every micro-batch, with media or not, takes its turn in the step's
            # features (outside a training step a full replica encodes here, as with none).
            features = self.step_encoding.take(grid_thw)
            return features if features.shape[0] else None
        return None if pixels is None else self._encode(pixels, grid_thw)

    def _encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged features [P/m^2, h] of every image and video, encoded here or shared out over
        the TP group (``parallel.encoder_dp=tp``)."""
        if self.shared_encoding is None:
            return self.projector(self.vision_model(pixels, grid_thw))
        trainable = self._trainable_encoder_params()
        return self.shared_encoding(lambda p, g: self.projector(self.vision_model(p, g)), trainable,
                                    pixels, grid_thw)

    def _placeholder_count(
        self, input_ids: torch.Tensor, token_id: int, grid_thw: Optional[torch.Tensor], what: str
    ) -> int:
        return placeholder_count(input_ids, token_id, grid_thw, what, self.merge_unit)


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


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device




def build_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    params_dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    device: torch.device | str,
    vp_stage: Optional[int] = None,
    recompute_activations: bool = False,
    init_seed: Optional[int] = None,
    vision_cost: Optional[Callable[[], VisionCost]] = None,
    with_encoder: bool = True,
) -> Qwen2_5_VLModel:
    """Build this rank's pipeline stage. Needs megatron's parallel state initialised to match
    ``parallel_cfg``. Collective (the vision TP groups): every rank calls it.
    ``recompute_activations``: full activation recompute in both towers.
    ``init_seed``: the seed of the initial weights (default: the seed torch's CPU generator was last
    seeded with, ``torch.initial_seed()``); the same seed gives the same full model at every TP, PP
    and vision-TP layout when weights are initialised on the CPU (``models.initialization``).
    ``vision_cost``: with ``parallel.encoder_dp=tp``, the current cost coefficients that divide
    each micro-batch's media over the TP group (the run's cost model); default P^2 + P.
    ``with_encoder=False``: no vision tower or merger (training on ``loongforge encode``'s
    stored features, passed to forward as ``image_embeds`` / ``video_embeds``)."""
    context = build_context(model_cfg, parallel_cfg, params_dtype=params_dtype, device=device, init_seed=init_seed)
    device, on_cpu, init_seed, modules = context.device, context.on_cpu, context.init_seed, context.modules
    language_pgs = context.pgs
    _check_qwen2_5_vl(model_cfg)
    vision_tp = configs.vision_tensor_parallel_size(parallel_cfg)
    vision_tp_group = build_vision_tp_group(language_pgs.tp, vision_tp)

    model = Qwen2_5_VLModel(
        model_cfg=model_cfg,
        language_config=decoder_configs.language_config(model_cfg.language, parallel_cfg, params_dtype, on_cpu,
                                                        recompute_layers=recompute_activations),
        vision_config=configs.vision_config(model_cfg, vision_tp, params_dtype, on_cpu,
                                            recompute=recompute_activations),
        projector_config=configs.projector_config(model_cfg, vision_tp, params_dtype, on_cpu),
        modules=modules,
        language_pgs=language_pgs,
        vision_tp_group=vision_tp_group,
        encoder_cp=context.encoder_cp,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        init_seed=init_seed,
        # encoder_dp=full: one replica per pipeline rank, on its first chunk (virtual stage 0).
        encoder_everywhere=parallel_cfg.encoder_dp == "full" and not vp_stage,
        with_encoder=with_encoder,
    )
    if model.vision_model is not None:
        for tower in (model.vision_model, model.projector):
            mark_tp_duplicates(tower, vision_tp=vision_tp, replica_block=model._vision_replica_block)
        sharing = sharing_groups(parallel_cfg, language_pgs)
        if sharing is not None:
            _share_encoder(model, sharing, language_pgs.tp, vision_tp=vision_tp, dtype=params_dtype,
                           vision_cost=vision_cost or VisionCost)
        if parallel_cfg.encoder_dp == "full":  # this rank's first chunk: its replica
            _encode_per_step(model, language_pgs, vision_tp=vision_tp, dtype=params_dtype,
                             vision_cost=vision_cost or VisionCost, recompute=parallel_cfg.encoder_full_recompute)
    return model.to(device)


def _share_encoder(model: Qwen2_5_VLModel, sharing: SharingGroups, tp_group, *, vision_tp: int,
                   dtype: torch.dtype, vision_cost: Callable[[], VisionCost]) -> None:
    """``parallel.encoder_dp=tp`` and/or ``encoder_cp``: the sharing group's ranks each encode a
    share of the media (``models.encoder_share``). TP sharing sums the encoder's gradients over the
    TP group (``parallel.encoder_dp``); the grad norm still counts the tower once: after the sum
    every TP rank holds the same gradient, and ``mark_tp_duplicates`` already counts a vision-TP-1
    tower on TP rank 0 only. CP sharing needs no more: the data-parallel reduction spans CP."""
    if sharing.tp_shares and vision_tp != 1:
        raise ValueError(f"parallel.encoder_dp=tp needs vision TP 1 (a whole encoder on every TP "
                         f"rank), got {vision_tp}")
    model.shared_encoding = SharedEncoding(
        sharing.group, merge_unit=model.merge_unit, width=model.model_cfg.projector.out_hidden_size,
        dtype=dtype, vision_cost=vision_cost, gradient_group=sharing.gradient_group)
    if sharing.tp_shares:
        for tower in (model.vision_model, model.projector):
            mark_encoder_replicas(tower.parameters(), tp_group)


def _encode_per_step(model: Qwen2_5_VLModel, pgs: ProcessGroupCollection, *, vision_tp: int,
                     dtype: torch.dtype, vision_cost: Callable[[], VisionCost], recompute: bool) -> None:
    """``parallel.encoder_dp=full``: every rank of the model-parallel group (TP x PP) holds an
    encoder replica and encodes a share of each step's media (``encoder_full``). The grad norm counts
    the towers once: ``mark_tp_duplicates`` counts a vision-TP-1 tower on TP rank 0 only, and the
    replicas of later pipeline stages are left out (``mark_pipeline_replicas``)."""
    if vision_tp != 1:
        raise ValueError(f"parallel.encoder_dp=full needs vision TP 1 (a whole encoder on every "
                         f"model-parallel rank), got {vision_tp}")
    model.step_encoding = StepEncoding(
        pgs.mp, role=(get_pg_rank(pgs.pp), get_pg_rank(pgs.tp)), receives=model.pre_process,
        merge_unit=model.merge_unit, width=model.model_cfg.projector.out_hidden_size, dtype=dtype,
        vision_cost=vision_cost, recompute=recompute)
    if model._pp_rank > 0:
        for tower in (model.vision_model, model.projector):
            mark_pipeline_replicas(tower.parameters())


def _check_qwen2_5_vl(model_cfg: ModelConfig) -> None:
    """Settings of other families this model has no part for are errors, not silently ignored."""
    vision, lang = model_cfg.vision, model_cfg.language
    foreign = [f"model.vision.norm={vision.norm}" if vision.norm != "rms" else "",
               "model.vision.window_size=null" if vision.window_size is None else "",
               "model.vision.num_position_embeddings" if vision.num_position_embeddings is not None else "",
               "model.vision.deepstack_layers" if vision.deepstack_layers else "",
               "model.language.mrope_interleaved" if lang.mrope_interleaved else ""]
    foreign = [item for item in foreign if item]
    if foreign:
        raise ValueError(f"{', '.join(foreign)}: not part of a Qwen2.5-VL model (RMSNorm vision blocks, no "
                         f"learned positions or DeepStack, contiguous M-RoPE); unset them")
