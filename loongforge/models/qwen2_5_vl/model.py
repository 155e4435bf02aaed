"""Qwen2.5-VL on megatron-core: vision tower -> projector -> M-RoPE GPT decoder.

Mirrors transformers' ``Qwen2_5_VLForConditionalGeneration`` module for module (see
``hf_mapping.py`` for the weight correspondence), with megatron-core doing tensor and pipeline
parallelism:

- ``vision_model`` (first pipeline stage only): patches -> patch features, TP over the vision group.
- ``projector``: the patch merger, 2x2 patch features -> one language-model token.
- ``language_model``: megatron-core ``GPTModel`` with ``position_embedding_type="mrope"``; it gets
  ``decoder_input`` (text embeddings with the projected image/video features written over the
  image/video placeholder tokens) and 3-D position ids.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models import initialization
from loongforge.models.layer_backend import BlockModules, block_modules, resolve_layer_backend
from loongforge.models.qwen2_5_vl import configs
from loongforge.models.qwen2_5_vl.encoder_share import SharedEncoding
from loongforge.models.qwen2_5_vl.layer_specs import language_block_spec, vision_layer_spec
from loongforge.models.qwen2_5_vl.process_groups import (
    build_vision_tp_group,
    mark_tp_duplicates,
)
from loongforge.models.qwen2_5_vl.vision import (
    PatchMerger,
    VisionModel,
    optional_cat,
    vision_pg_collection,
)
from loongforge.parallel import mcore_patches
from loongforge.parallel.encoder_dp import mark_encoder_replicas, touch_with_zero
from loongforge.parallel.media_assign import VisionCost


class LanguageModel(GPTModel):
    """``GPTModel`` whose loss ignores the vocabulary-padding logits.

    The output layer has ``padded_vocab_size`` rows; padded rows would still add ``exp(logit)`` to
    the softmax denominator, so their logits are set to -inf before the cross entropy.
    """

    def __init__(self, *args, true_vocab_size: int, init_seed: Optional[int] = None, **kwargs):
        # The embedding is GPTModel's first random draw; the decoder layers draw from keys of their
        # own (see the block spec) and leave this stream alone.
        with initialization.seeded(init_seed, "language_model.embedding"):
            super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        if (init_seed is not None and self.post_process and not self.share_embeddings_and_output_weights
                and initialization.draws_on_cpu(self.config)):
            # GPTModel drew it from the embedding's stream, which only a stage holding the embedding
            # had advanced: draw it again from a key of its own.
            initialization.redraw_sharded(
                self.output_layer.weight, (self.vocab_size, self.config.hidden_size),
                self.config.init_method, seed=init_seed, key="language_model.output_layer",
                tp_rank=get_pg_rank(self.pg_collection.tp), tp_size=self.pg_collection.tp.size())

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_size > self.true_vocab_size:
            # logits [s, b, V/tp]: this rank holds vocab ids [rank*V/tp, (rank+1)*V/tp)
            shard = logits.shape[-1]
            first_id = get_pg_rank(self.pg_collection.tp) * shard
            vocab_ids = torch.arange(first_id, first_id + shard, device=logits.device)
            logits = logits.masked_fill(vocab_ids >= self.true_vocab_size, float("-inf"))
        return super().compute_language_model_loss(labels, logits)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, loss_mask=None,
                     **kwargs):
        """With ``loss_mask``, run the LM head and cross entropy only where the loss counts.

        In VLM fine-tuning most positions (system prompt, question, image tokens, padding) carry no
        loss, and the head over a 152k vocabulary is the largest matmul of a small model: skipping
        them changes no gradient and saves most of that work. Returns per-token loss [b, s], zero
        outside the mask.
        """
        if (not self.post_process or labels is None or loss_mask is None
                or getattr(self, "mtp_process", False)):
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args,
                                        loss_mask=loss_mask, **kwargs)
        if self.config.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]: every TP rank needs the full sequence to pick positions.
            # The head's input copy all-reduces its gradient, so each rank already holds the full
            # gradient here: the backward only splits it (no second reduction).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp)
        seq_len, batch = hidden_states.shape[:2]
        # Positions in [s, b] order, the layout of hidden_states.
        picked = loss_mask.transpose(0, 1).reshape(-1).nonzero(as_tuple=True)[0]  # [n]
        picked_hidden = hidden_states.reshape(seq_len * batch, 1, -1)[picked]  # [n, 1, h]
        output_weight = self.shared_embedding_or_output_weight() if (
            self.share_embeddings_and_output_weights) else None
        sequence_parallel = self.output_layer.sequence_parallel
        self.output_layer.sequence_parallel = False  # already gathered above
        try:
            logits, _ = self.output_layer(picked_hidden, weight=output_weight)  # [n, 1, V/tp]
        finally:
            self.output_layer.sequence_parallel = sequence_parallel
        picked_labels = labels.transpose(0, 1).reshape(-1)[picked].unsqueeze(0)  # [1, n]
        picked_loss = self.compute_language_model_loss(picked_labels, logits)  # [1, n]
        loss = torch.zeros(seq_len * batch, dtype=picked_loss.dtype, device=picked_loss.device)
        loss = loss.index_put((picked,), picked_loss.reshape(-1))
        return loss.reshape(seq_len, batch).transpose(0, 1).contiguous()  # [b, s]


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
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int] = None,
        init_seed: Optional[int] = None,
        with_encoder: bool = True,
    ):
        """``init_seed``: initial weights keyed by (seed, global name), the same full model at
        every TP/PP layout (``models.initialization``); None: megatron's one running stream.
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
        if pre_process and with_encoder:
            with initialization.seeded(init_seed, "vision_model"):
                self.vision_model = VisionModel(
                    vision_config,
                    model_cfg,
                    vision_layer_spec(modules),
                    vision_pg_collection(vision_tp_group, language_pgs),
                )
            with initialization.seeded(init_seed, "projector"):
                self.projector = PatchMerger(projector_config, model_cfg, vision_tp_group, modules)
        # With a vision TP smaller than the language TP, the towers are replicated across the
        # language TP group in blocks of vision-TP ranks: block k holds replica k of every shard.
        self._vision_tp = vision_tp_group.size()
        self._vision_replica_block = get_pg_rank(language_pgs.tp) // self._vision_tp
        # parallel.encoder_dp=tp: the TP group divides each micro-batch's media (build_model).
        self.shared_encoding: Optional[SharedEncoding] = None

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

    # -- pipeline plumbing (megatron schedules and finalize_model_grads call these) -------------

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return self.language_model.shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.pre_process and self._vision_replica_block:
            towers = (f"{prefix}vision_model.", f"{prefix}projector.")
            for key, item in sharded.items():
                if key.startswith(towers):
                    item.replica_id = _with_tp_replica_block(item.replica_id, self._vision_replica_block,
                                                             self._vision_tp)
        return sharded

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
    ) -> torch.Tensor:
        """Per-token loss [b, s] fp32 when ``labels`` is given, else logits [b, s, V_padded/tp].

        With ``loss_mask`` [b, s] as well, the LM head runs only where the mask is non-zero and the
        loss is zero elsewhere (same gradients, much less work on a large vocabulary).

        input_ids [b, s]; position_ids [3, b, s] (M-RoPE t/h/w); labels [b, s] next-token targets,
        valid ids everywhere (the caller masks); packed_seq_params: thd with b == 1 and cu_seqlens
        over all b*s tokens; pixel_values [P, C*T*p*p] with image_grid_thw [n, 3], likewise videos;
        or, for a model built without the encoder, image_embeds [P/m^2, h] (and video_embeds) with
        the grids.
        On later pipeline stages the hidden states come from ``set_input_tensor`` instead.
        """
        _check_inputs(input_ids, position_ids, packed_seq_params)
        decoder_input = None
        if self.pre_process:
            decoder_input = self.embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                stored=optional_cat(image_embeds, video_embeds),
            )
        return self.language_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=None,
            decoder_input=decoder_input,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed_seq_params,
        )

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: Optional[torch.Tensor],
        image_grid_thw: Optional[torch.Tensor],
        pixel_values_videos: Optional[torch.Tensor],
        video_grid_thw: Optional[torch.Tensor],
        stored: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Text embeddings with image/video features in place of their placeholders: [s, b, h].
        ``stored`` [P/m^2, h]: the images' then the videos' features, computed offline."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        tokens = self.model_cfg.tokens
        image_count = self._placeholder_count(input_ids, tokens.image_token_id, image_grid_thw, "image")
        video_count = self._placeholder_count(input_ids, tokens.video_token_id, video_grid_thw, "video")
        pixels = optional_cat(pixel_values, pixel_values_videos)
        if pixels is not None or stored is not None:
            # Images and videos go through the tower together: segments never cross an image, so
            # this equals two separate calls and costs one.
            grid_thw = optional_cat(image_grid_thw, video_grid_thw)
            features = self._features(pixels, grid_thw, stored).to(embeddings.dtype)
            image_features, video_features = features.split([image_count, video_count])
            embeddings = _scatter_features(embeddings, input_ids, tokens.image_token_id, image_features)
            embeddings = _scatter_features(embeddings, input_ids, tokens.video_token_id, video_features)
        elif self.vision_model is not None:
            # No media in this micro-batch: the encoder still reports a zero gradient to the DDP.
            embeddings = touch_with_zero(embeddings, self._encoder_parameters())
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
                embeddings, group=self.language_model.pg_collection.tp
            )
        return embeddings

    def _features(self, pixels: Optional[torch.Tensor], grid_thw: torch.Tensor,
                  stored: Optional[torch.Tensor]) -> torch.Tensor:
        """Merged features [P/m^2, h]: stored ones for a model without the encoder, else encoded."""
        if self.vision_model is None:
            if stored is None:
                raise ValueError("this model was built without the vision encoder (data.vision_embeddings): "
                                 "pass image_embeds / video_embeds, not pixels")
            return stored
        if stored is not None:
            raise ValueError("image_embeds / video_embeds given to a model that runs its own encoder")
        return self._encode(pixels, grid_thw)

    def _encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged features [P/m^2, h] of every image and video, encoded here or shared out over
        the TP group (``parallel.encoder_dp=tp``)."""
        if self.shared_encoding is None:
            return self.projector(self.vision_model(pixels, grid_thw))
        return self.shared_encoding(lambda p, g: self.projector(self.vision_model(p, g)),
                                    self._encoder_parameters(), pixels, grid_thw)

    def _encoder_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters of the vision tower and the projector."""
        return [param for tower in (self.vision_model, self.projector)
                for param in tower.parameters() if param.requires_grad]

    def _placeholder_count(
        self, input_ids: torch.Tensor, token_id: int, grid_thw: Optional[torch.Tensor], what: str
    ) -> int:
        """Merged-patch count of the images (or videos); must equal their placeholder tokens."""
        num_tokens = int((input_ids == token_id).sum())
        num_features = 0 if grid_thw is None else int(grid_thw.prod(-1).sum()) // self.merge_unit
        if num_tokens != num_features:
            grids = None if grid_thw is None else grid_thw.tolist()
            raise ValueError(
                f"input_ids hold {num_tokens} {what} tokens (id {token_id}) but the {what}s give "
                f"{num_features} merged patches ({what}_grid_thw={grids})"
            )
        return num_features


def _scatter_features(
    embeddings: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor
) -> torch.Tensor:
    """Write features [n, h] over the placeholder positions, in (batch, position) order."""
    if features.shape[0] == 0:
        return embeddings
    mask = (input_ids == token_id)[..., None]  # [b, s, 1]
    merged = embeddings.transpose(0, 1).masked_scatter(mask, features)  # [b, s, h]
    return merged.transpose(0, 1).contiguous()


def _with_tp_replica_block(replica_id, block: int, vision_tp: int):
    """Shift the TP part of a megatron replica id (an int or (pp, tp, dp)) past the replica blocks
    before this one, so that exactly one rank owns (replica 0) each vision shard."""
    if isinstance(replica_id, tuple):
        return (replica_id[0], replica_id[1] + block * vision_tp, *replica_id[2:])
    return replica_id + block * vision_tp


def _check_inputs(input_ids, position_ids, packed_seq_params) -> None:
    batch, seq_len = input_ids.shape
    if position_ids.dim() != 3 or position_ids.shape != (3, batch, seq_len):
        raise ValueError(
            f"position_ids must be [3, b, s] = [3, {batch}, {seq_len}], got {list(position_ids.shape)}"
        )
    if packed_seq_params is not None:
        if batch != 1:
            raise ValueError(f"packed (thd) input needs batch size 1, got {batch}")
        covered = int(packed_seq_params.cu_seqlens_q[-1])
        if covered != seq_len:
            # M-RoPE and the core attention index tokens by cu_seqlens: trailing padding must be
            # a segment of its own.
            raise ValueError(f"cu_seqlens_q[-1]={covered} must equal the sequence length {seq_len}")


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
    init_seed = torch.initial_seed() if init_seed is None else init_seed
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    if on_cpu:
        mcore_patches.apply_cpu()
    modules = block_modules(resolve_layer_backend(model_cfg.layer_backend, device, params_dtype))

    language_pgs = ProcessGroupCollection.use_mpu_process_groups()
    _check_parallel_state(parallel_cfg, language_pgs)
    vision_tp = configs.vision_tensor_parallel_size(parallel_cfg)
    vision_tp_group = build_vision_tp_group(language_pgs.tp, vision_tp)

    model = Qwen2_5_VLModel(
        model_cfg=model_cfg,
        language_config=configs.language_config(model_cfg, parallel_cfg, params_dtype, on_cpu,
                                                recompute=recompute_activations),
        vision_config=configs.vision_config(model_cfg, vision_tp, params_dtype, on_cpu,
                                            recompute=recompute_activations),
        projector_config=configs.projector_config(model_cfg, vision_tp, params_dtype, on_cpu),
        modules=modules,
        language_pgs=language_pgs,
        vision_tp_group=vision_tp_group,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        init_seed=init_seed,
        with_encoder=with_encoder,
    )
    if model.vision_model is not None:
        for tower in (model.vision_model, model.projector):
            mark_tp_duplicates(tower, vision_tp=vision_tp, replica_block=model._vision_replica_block)
        if parallel_cfg.encoder_dp == "tp" and language_pgs.tp.size() > 1:
            _share_encoder(model, language_pgs.tp, vision_tp=vision_tp, dtype=params_dtype,
                           vision_cost=vision_cost or VisionCost)
    return model.to(device)


def _share_encoder(model: Qwen2_5_VLModel, tp_group, *, vision_tp: int, dtype: torch.dtype,
                   vision_cost: Callable[[], VisionCost]) -> None:
    """``parallel.encoder_dp=tp``: the TP group's ranks each encode a share of the media, and
    the encoder's gradients are summed over the group (``parallel.encoder_dp``). The grad norm
    still counts the tower once: after the sum every TP rank holds the same gradient, and
    ``mark_tp_duplicates`` already counts a vision-TP-1 tower on TP rank 0 only."""
    if vision_tp != 1:
        raise ValueError(f"parallel.encoder_dp=tp needs vision TP 1 (a whole encoder on every TP "
                         f"rank), got {vision_tp}")
    model.shared_encoding = SharedEncoding(
        tp_group, merge_unit=model.merge_unit, width=model.model_cfg.projector.out_hidden_size,
        dtype=dtype, vision_cost=vision_cost)
    for tower in (model.vision_model, model.projector):
        mark_encoder_replicas(tower.parameters(), tp_group)


def _check_parallel_state(parallel_cfg: ParallelConfig, pgs: ProcessGroupCollection) -> None:
    for key, group in (("tensor_model_parallel_size", pgs.tp), ("pipeline_model_parallel_size", pgs.pp)):
        expected = getattr(parallel_cfg, key)
        if group is None or group.size() != expected:
            actual = None if group is None else group.size()
            raise ValueError(
                f"parallel.{key}={expected} but megatron's parallel state has {actual}; call "
                "megatron.core.parallel_state.initialize_model_parallel with the same sizes first"
            )
