"""A text-only causal LM (Qwen2 / Qwen3 / Llama 3.x) on megatron-core.

The model is the decoder every family builds (``models.decoder.LanguageModel``) with 1-D RoPE;
this module gives it the forward signature the training step calls every family with. Rotary
positions come from the packed layout: megatron restarts them at every ``cu_seqlens`` segment,
which is what the data pipeline's per-sample positions (0..len-1, three equal rows) say.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.config.schema import ModelConfig, ParallelConfig, TrainingConfig
from loongforge.models.decoder import configs as decoder_configs
from loongforge.models.decoder.build import (
    build_context,
    build_language_model,
    check_inputs,
)
from loongforge.models.layers.layer_backend import BlockModules
from loongforge.models.decoder.moe_balance import routing_padding_mask
from loongforge.models.media import MediaBatch
from loongforge.parallel.context_parallel import ContextShard



class TextModel(MegatronModule):
    """One pipeline stage of a text-only LLM. Build it with ``build_model``."""

    def __init__(self, *, model_cfg: ModelConfig, language_config: TransformerConfig, modules: BlockModules,
                 pgs: ProcessGroupCollection, pre_process: bool, post_process: bool,
                 vp_stage: Optional[int] = None, init_seed: Optional[int] = None,
                 loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens):
        super().__init__(config=language_config)
        lang = model_cfg.language
        self.model_cfg = model_cfg
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = lang.tie_word_embeddings
        self.layer_backends = {"language": modules.describe()}
        self.model_type = ModelType.encoder_or_decoder
        self.language_model = build_language_model(
            model_cfg, language_config, modules, pgs, pre_process=pre_process, post_process=post_process,
            vp_stage=vp_stage, init_seed=init_seed, rope="rope", takes_features=False,
            loss_chunk_tokens=loss_chunk_tokens)

    def towers(self) -> dict[str, list[torch.nn.Module]]:
        """The parts ``training.freeze_*`` name: no encoder parts, so freeze_vision / freeze_projector
        freeze nothing."""
        return {"vision": [], "projector": [], "language": [self.language_model]}

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        return self.language_model.shared_embedding_or_output_weight()

    def begin_step(self, micro_batches: list[dict]) -> int:
        """No encoder work to schedule ahead of the pipeline: 0 bytes held."""
        return 0

    def finish_step(self) -> list:
        return []

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, loss_mask: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None, context_shard: Optional[ContextShard] = None,
                media: Optional[MediaBatch] = None) -> torch.Tensor:
        """Per-token loss [b, s] fp32 with ``labels`` (the LM head only where ``loss_mask`` counts),
        else logits [b, s, V_padded/tp]. input_ids [b, s]; position_ids [3, b, s] (three equal rows:
        the positions the packed layout implies); packed_seq_params: thd with b == 1;
        ``padding_mask`` [b, s] (True on padding) keeps padding out of MoE routing statistics.
        ``context_shard``: under context parallelism, the per-token inputs are this CP rank's s / CP
        tokens of the row (``parallel.context_parallel``); positions and cu_seqlens stay the row's.
        ``media``: the batch's (``models.media.MediaBatch``), which must hold none."""
        if media:
            raise ValueError(f"a text-only model takes no images or videos, got {sum(1 for _ in media.items())}")
        check_inputs(input_ids, position_ids, packed_seq_params, context_shard)
        padding_mask = routing_padding_mask(padding_mask, self.language_model.config,
                                            scattered_by_gpt_model=self.pre_process)
        return self.language_model(input_ids=input_ids, position_ids=position_ids[0], attention_mask=None,
                                   labels=labels, loss_mask=loss_mask, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, params_dtype: torch.dtype,
                pre_process: bool, post_process: bool, device: torch.device | str,
                vp_stage: Optional[int] = None, recompute_activations: bool = False,
                init_seed: Optional[int] = None, vision_cost=None, with_encoder: bool = True,
                loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens) -> TextModel:
    """This rank's pipeline stage; needs megatron's parallel state initialised to ``parallel_cfg``.
    ``vision_cost`` and ``with_encoder`` are part of the family contract's build call and have
    nothing to act on in a text-only model."""
    context = build_context(model_cfg, parallel_cfg, params_dtype=params_dtype, device=device, init_seed=init_seed)
    model = TextModel(
        model_cfg=model_cfg,
        language_config=decoder_configs.language_config(model_cfg.language, parallel_cfg, params_dtype,
                                                        context.on_cpu, recompute_layers=recompute_activations),
        modules=context.modules, pgs=context.pgs, pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, init_seed=context.init_seed, loss_chunk_tokens=loss_chunk_tokens)
    return model.to(context.device)
