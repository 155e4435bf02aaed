"""Qwen3-VL (dense) on megatron-core: vision tower -> mergers -> Qwen3 decoder with interleaved
M-RoPE and DeepStack.

Mirrors transformers' ``Qwen3VLForConditionalGeneration`` (``hf_mapping.py`` gives the weight
correspondence), with megatron-core doing tensor and pipeline parallelism:

- ``vision_model`` (first pipeline stage only): patches -> patch features, plus the outputs of the
  DeepStack blocks; TP over the language TP group.
- ``projector``: the main merger, 2x2 patch features -> one language-model token.
- ``deepstack_projectors``: one merger per DeepStack block (norm after the 2x2 concatenation).
- ``language_model``: the shared decoder (``models.decoder``, Qwen3 blocks: per-head q/k RMSNorm,
  no qkv bias) with ``InterleavedMRoPE`` in place of megatron's chunked M-RoPE. It gets
  ``decoder_input`` (text embeddings with merged features over the image/video placeholders) and,
  when there is media, the DeepStack features as the block's ``context`` (``deepstack.py``).
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
from loongforge.config.schema import ModelConfig, ParallelConfig
from loongforge.models.decoder import configs as decoder_configs
from loongforge.models.decoder.build import build_context, check_inputs, placeholder_count
from loongforge.models.decoder.language_model import LanguageModel
from loongforge.models.moe_balance import routing_padding_mask
from loongforge.models.decoder.layer_specs import language_block_spec
from loongforge.models.decoder.params import head_dim
from loongforge.models.hf_rules import padded_vocab_size
from loongforge.models.layer_backend import BlockModules
from loongforge.models.qwen3_vl import configs, deepstack
from loongforge.models.qwen3_vl.vision_facts import Qwen3VisionConfig
from loongforge.models.qwen3_vl.rotary import InterleavedMRoPE
from loongforge.models.qwen3_vl.encoder import build_towers, encode_with
from loongforge.models.qwen3_vl.vision import MergerList, PatchMerger, VisionModel
from loongforge.models.vision_common import held_features, optional_cat, scatter_features, written_over
from loongforge.models.encoder_share import SharedEncoding, sharing_groups
from loongforge.parallel.context_parallel import ContextShard
from loongforge.parallel.media_assign import VisionCost
from loongforge.parallel.encoder_dp import touch_with_zero


class Qwen3VLModel(MegatronModule):
    """One pipeline stage of Qwen3-VL. Build it with ``build_model``."""

    def __init__(
        self,
        *,
        model_cfg: ModelConfig,
        vision: Qwen3VisionConfig,
        language_config: TransformerConfig,
        vision_config: TransformerConfig,
        merger_config: TransformerConfig,
        modules: BlockModules,
        language_pgs: ProcessGroupCollection,
        encoder_cp: torch.distributed.ProcessGroup,
        pre_process: bool,
        post_process: bool,
        vp_stage: Optional[int] = None,
        init_seed: Optional[int] = None,
        with_encoder: bool = True,
    ):
        """``init_seed``: initial weights keyed by (seed, global name), the same full model at
        every TP/PP layout (``models.initialization``); None: megatron's one running stream.
        ``with_encoder=False``: no towers; each micro-batch brings its features (``image_embeds`` /
        ``video_embeds`` [tokens, (1 + k) * h]: the merger's, then DeepStack's, ``encoder.py``)."""
        super().__init__(config=language_config)
        self.model_cfg = model_cfg
        self.vision = vision
        self.pre_process = pre_process
        self.post_process = post_process
        self.merge_unit = vision.spatial_merge_size**2
        self.share_embeddings_and_output_weights = model_cfg.language.tie_word_embeddings
        self.layer_backends = {"vision": modules.describe(), "language": modules.describe()}
        # megatron's pipeline schedules read this: one decoder stack, no separate encoder stages.
        self.model_type = ModelType.encoder_or_decoder

        self.vision_model: Optional[VisionModel] = None
        self.projector: Optional[PatchMerger] = None
        self.deepstack_projectors: Optional[MergerList] = None
        # parallel.encoder_cp: the CP group divides each micro-batch's media (build_model).
        self.shared_encoding: Optional[SharedEncoding] = None
        if pre_process and with_encoder:
            self.vision_model, self.projector, self.deepstack_projectors = build_towers(
                vision, vision_config, merger_config, modules, language_pgs.tp, language_pgs, init_seed,
                cp_group=encoder_cp)
        if not with_encoder:
            self.layer_backends["vision"] = "none (stored embeddings)"

        lang = model_cfg.language
        self.language_model = LanguageModel(
            config=language_config,
            transformer_layer_spec=language_block_spec(
                language_config, modules, pp_rank=get_pg_rank(language_pgs.pp), vp_stage=vp_stage,
                init_seed=init_seed,
            ),
            vocab_size=padded_vocab_size(lang.vocab_size, language_pgs.tp.size()),
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
        # GPTModel calls rotary_pos_emb(position_ids, mrope_section, cp_group=...): same call,
        # interleaved frequency layout.
        self.language_model.rotary_pos_emb = InterleavedMRoPE(
            head_dim(lang), lang.mrope_section, lang.rope_theta)
        if pre_process:
            deepstack.install_hooks(self.language_model.decoder.layers, vision.num_deepstack_layers)

    def towers(self) -> dict[str, list[torch.nn.Module]]:
        """The parts this rank holds, by what ``training.freeze_*`` names them."""
        return {"vision": [m for m in (self.vision_model,) if m is not None],
                "projector": [m for m in (self.projector, self.deepstack_projectors) if m is not None],
                "language": [self.language_model]}

    def begin_step(self, micro_batches: list[dict]) -> int:
        """Nothing is encoded ahead of the pipeline (no ``encoder_dp=full``): 0 bytes held."""
        return 0

    def finish_step(self) -> list:
        return []

    # -- pipeline plumbing (megatron schedules and finalize_model_grads call these) -------------

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return self.language_model.shared_embedding_or_output_weight()

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
        For a model built without the encoder: ``image_embeds`` / ``video_embeds`` [P/m^2, (1 + k) h]
        (the merger's then DeepStack's features, ``encoder.py``) with the grids, instead of pixels.

        ``padding_mask`` [b, s] (True on padding) keeps padding out of MoE routing statistics.
        With ``loss_mask`` [b, s] as well, the LM head runs only where the mask is non-zero and the
        loss is zero elsewhere.

        input_ids [b, s]; position_ids [3, b, s] (interleaved M-RoPE t/h/w, ``rope_index``);
        labels [b, s] next-token targets, valid ids everywhere (the caller masks);
        packed_seq_params: thd with b == 1 and cu_seqlens over all b*s tokens; pixel_values
        [P, C*T*p*p] with image_grid_thw [n, 3], likewise videos. On later pipeline stages the
        hidden states come from ``set_input_tensor`` instead.

        ``context_shard``: under context parallelism the per-token inputs (and the output) are this
        CP rank's s / CP tokens of the row; positions and cu_seqlens stay the whole row's, and each
        CP rank writes (and DeepStack adds) the features of its own placeholders.
        """
        check_inputs(input_ids, position_ids, packed_seq_params, context_shard)
        decoder_input, context = None, None
        if self.pre_process:
            decoder_input, context = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                video_grid_thw, stored=optional_cat(image_embeds, video_embeds),
                                                context_shard=context_shard)
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
            extra_block_kwargs=None if context is None else {"context": context},
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
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(text embeddings with merged features over their placeholders [s, b, h], DeepStack
        context [s, b, k, h] or None without media); both [s/tp, ...] under sequence parallelism.
        ``stored`` [P/m^2, (1 + k) * h]: the images' then the videos' features, computed offline.
        ``context_shard``: ``input_ids`` are this CP rank's tokens; the features are the row's."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        tokens = self.model_cfg.tokens
        row_ids = input_ids if context_shard is None else context_shard.row_input_ids
        counts = [self._placeholder_count(row_ids, tokens.image_token_id, image_grid_thw, "image"),
                  self._placeholder_count(row_ids, tokens.video_token_id, video_grid_thw, "video")]
        pixels = optional_cat(pixel_values, pixel_values_videos)
        context = None
        if self.vision_model is None and pixels is not None:
            raise ValueError("this model was built without the vision encoder (data.vision_embeddings): pass "
                             "image_embeds / video_embeds, not pixels")
        if self.vision_model is not None and stored is not None:
            raise ValueError("image_embeds / video_embeds given to a model that runs its own encoder")
        if stored is not None:
            features, *deepstack_features = stored.chunk(1 + self.vision.num_deepstack_layers, dim=-1)
        elif pixels is not None:
            # Images and videos go through the tower together: attention never crosses a frame and
            # position embeddings are per image, so this equals two separate calls.
            features, deepstack_features = self._encode(pixels, optional_cat(image_grid_thw, video_grid_thw))
        if stored is not None or pixels is not None:
            token_ids = (tokens.image_token_id, tokens.video_token_id)
            for token_id, part in zip(token_ids, features.to(embeddings.dtype).split(counts)):
                embeddings = scatter_features(embeddings, input_ids, token_id, held_features(part, token_id, context_shard))
            embeddings = written_over(embeddings, torch.cat([features, *deepstack_features], dim=-1), context_shard)
            if deepstack_features:
                parts = [f.to(embeddings.dtype).split(counts) for f in deepstack_features]  # [k][image, video]
                per_token = [(token_id, [held_features(p[kind], token_id, context_shard) for p in parts])
                             for kind, token_id in enumerate(token_ids) if counts[kind]]
                context = deepstack.dense_context(input_ids, per_token, tuple(embeddings.shape))
        elif self.vision_model is not None:
            # No media in this micro-batch: the encoder still reports a zero gradient to the DDP.
            embeddings = touch_with_zero(embeddings, self._trainable_encoder_params())
        if self.config.sequence_parallel:
            group = self.language_model.pg_collection.tp
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=group)
            if context is not None:
                context = tensor_parallel.scatter_to_sequence_parallel_region(context, group=group)
        return embeddings, context

    def _encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged features [P/m^2, h] and the k DeepStack feature sets [P/m^2, h], decoder layer order;
        under ``parallel.encoder_cp`` each CP rank encodes a share and all are gathered."""
        if self.shared_encoding is None:
            return encode_with(self.vision_model, self.projector, self.deepstack_projectors, self.vision,
                               pixels, grid_thw)
        features = self.shared_encoding(self._encode_concatenated, self._trainable_encoder_params(),
                                        pixels, grid_thw)  # [P/m^2, (1 + k) h]
        merged, *deepstack_features = features.chunk(1 + self.vision.num_deepstack_layers, dim=-1)
        return merged, deepstack_features

    def _encode_concatenated(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[P/m^2, (1 + k) h]: the merger's features then DeepStack's, per merged token."""
        merged, deepstack_features = encode_with(self.vision_model, self.projector, self.deepstack_projectors,
                                                 self.vision, pixels, grid_thw)
        return torch.cat([merged, *deepstack_features], dim=-1)

    def _trainable_encoder_params(self) -> list[torch.nn.Parameter]:
        return [param for tower in (self.vision_model, self.projector, self.deepstack_projectors)
                for param in tower.parameters() if param.requires_grad]

    def _placeholder_count(self, input_ids: torch.Tensor, token_id: int, grid_thw: Optional[torch.Tensor],
                           what: str) -> int:
        return placeholder_count(input_ids, token_id, grid_thw, what, self.merge_unit)




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
    vision: Optional[Qwen3VisionConfig] = None,
    vision_cost: Optional[Callable[[], VisionCost]] = None,
    with_encoder: bool = True,
) -> Qwen3VLModel:
    """Build this rank's pipeline stage. Needs megatron's parallel state initialised to match
    ``parallel_cfg``. ``recompute_activations``: full activation recompute in both towers.
    ``init_seed``: the seed of the initial weights (default ``torch.initial_seed()``).
    ``vision``: the Qwen3-VL vision facts; default ``Qwen3VisionConfig.from_model_cfg(model_cfg)``
    (which needs the Qwen3-VL fields of ``model.vision``). ``vision_cost``: the current cost
    coefficients that divide each micro-batch's media over the CP group (``parallel.encoder_cp``);
    default P^2 + P. (Qwen3-VL runs encoder_dp=none.)
    ``with_encoder=False``: no towers (training on ``loongforge encode``'s stored features, the
    merger's and DeepStack's)."""
    vision = vision or Qwen3VisionConfig.from_model_cfg(model_cfg)
    context = build_context(model_cfg, parallel_cfg, params_dtype=params_dtype, device=device, init_seed=init_seed)
    device, on_cpu, init_seed, modules = context.device, context.on_cpu, context.init_seed, context.modules
    language_pgs = context.pgs
    _check_model(model_cfg, vision)
    tp = parallel_cfg.tensor_model_parallel_size
    if vision_tensor_parallel_size(parallel_cfg) != tp:
        raise ValueError(f"parallel.vision_tensor_model_parallel_size={parallel_cfg.vision_tensor_model_parallel_size}"
                         f": Qwen3-VL's vision tower runs at the language TP size ({tp}); leave it null")
    if parallel_cfg.encoder_dp != "none":
        raise ValueError(f"parallel.encoder_dp={parallel_cfg.encoder_dp!r} is not supported by Qwen3-VL yet; use none")
    language_config = decoder_configs.language_config(model_cfg.language, parallel_cfg, params_dtype, on_cpu,
                                                      recompute_layers=recompute_activations)
    deepstack.check_pipeline(language_config, vision.num_deepstack_layers)
    model = Qwen3VLModel(
        model_cfg=model_cfg,
        vision=vision,
        language_config=language_config,
        vision_config=configs.vision_config(vision, tp, params_dtype, on_cpu, recompute=recompute_activations),
        merger_config=configs.merger_config(vision, tp, params_dtype, on_cpu),
        modules=modules,
        language_pgs=language_pgs,
        encoder_cp=context.encoder_cp,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        init_seed=init_seed,
        with_encoder=with_encoder,
    )
    sharing = sharing_groups(parallel_cfg, language_pgs)
    if sharing is not None and model.vision_model is not None:
        width = (1 + vision.num_deepstack_layers) * vision.out_hidden_size
        model.shared_encoding = SharedEncoding(sharing.group, merge_unit=model.merge_unit, width=width,
                                               dtype=params_dtype, vision_cost=vision_cost or VisionCost,
                                               gradient_group=sharing.gradient_group)
    return model.to(device)


def _check_model(model_cfg: ModelConfig, vision: Qwen3VisionConfig) -> None:
    lang = model_cfg.language
    if vision.out_hidden_size != lang.hidden_size:
        raise ValueError(f"vision out_hidden_size={vision.out_hidden_size} must equal "
                         f"model.language.hidden_size={lang.hidden_size}")
    if not lang.mrope_section:
        raise ValueError("model.language.mrope_section must be set for Qwen3-VL (interleaved M-RoPE)")
    if not lang.mrope_interleaved:
        raise ValueError("model.language.mrope_interleaved=false: Qwen3-VL's M-RoPE is interleaved")
