"""What every family's ``build_model`` does before building its modules, and the input checks every
family's forward makes: one place for each."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_pg_rank

from loongforge.config.schema import ModelConfig, ParallelConfig, TrainingConfig
from loongforge.models.decoder.language_model import LanguageModel
from loongforge.models.decoder.layer_specs import language_block_spec, mtp_block_spec
from loongforge.models.hf.rules import padded_vocab_size
from loongforge.models.layers.layer_backend import (
    BlockModules,
    block_modules,
    resolve_experts,
    resolve_layer_backend,
)
from loongforge.parallel import mcore_patches
from loongforge.parallel.context_parallel import ContextShard


@dataclass(frozen=True)
class BuildContext:
    device: torch.device
    on_cpu: bool
    init_seed: int
    modules: BlockModules  # what the transformer blocks are built from (``model.layer_backend``)
    pgs: ProcessGroupCollection  # megatron's groups (the language model's)
    # The CP group the encoders are built with: this rank alone (they never split a row), the
    # language's own at CP 1.
    encoder_cp: torch.distributed.ProcessGroup


def build_context(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, params_dtype: torch.dtype,
                  device: torch.device | str, init_seed: Optional[int]) -> BuildContext:
    """The device, the seed of the initial weights (default: ``torch.initial_seed()``), the layer
    backend and megatron's process groups, checked against ``parallel_cfg``; on CPU, megatron's
    CUDA-only call sites patched (``parallel.mcore_patches``)."""
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    mcore_patches.apply_fixes()
    if on_cpu:
        mcore_patches.apply_cpu()
    elif importlib.util.find_spec("transformer_engine") is None:
        mcore_patches.apply_without_te()  # megatron's MoE router needs TE or this fix
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    check_parallel_state(parallel_cfg, pgs)
    return BuildContext(device=device, on_cpu=on_cpu,
                        init_seed=torch.initial_seed() if init_seed is None else init_seed,
                        modules=block_modules(resolve_layer_backend(model_cfg.layer_backend, device, params_dtype), device,
                                              linear_attention_layers=model_cfg.language.linear_attention is not None,
                                              experts=_experts(model_cfg, device, params_dtype)),
                        pgs=pgs, encoder_cp=_single_rank_group(pgs.cp))


def _experts(model_cfg: ModelConfig, device: torch.device, params_dtype: torch.dtype) -> Optional[str]:
    """The routed experts' module (``model.language.moe.experts`` resolved); None without experts."""
    moe = model_cfg.language.moe
    return None if moe is None else resolve_experts(moe.experts, device, params_dtype)


def build_language_model(model_cfg: ModelConfig, language_config, modules: BlockModules,
                         pgs: ProcessGroupCollection, *, pre_process: bool, post_process: bool,
                         vp_stage: Optional[int], init_seed: Optional[int], rope: str,
                         takes_features: bool, routing_token_ids: tuple[int, ...] = (),
                         loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens) -> LanguageModel:
    """This stage of the shared decoder (``LanguageModel``), as every family builds it.

    ``rope``: ``"rope"`` (1-D positions) or ``"mrope"`` (three rows of positions, t/h/w).
    ``takes_features``: the caller writes vision features into the embeddings before the decoder
    runs, so the embeddings are scattered over sequence parallelism by the caller, not by GPTModel.
    ``loss_chunk_tokens``: the LM head's loss tokens at a time (``training.loss_chunk_tokens``; 0: all)."""
    lang = model_cfg.language
    # The multi-token-prediction layers sit after the decoder, on the last stage (with a copy of the embedding).
    mtp = mtp_block_spec(language_config, modules, init_seed) if lang.mtp_num_layers and post_process else None
    return LanguageModel(
        config=language_config,
        transformer_layer_spec=language_block_spec(
            language_config, modules, pp_rank=get_pg_rank(pgs.pp), vp_stage=vp_stage, init_seed=init_seed,
            vision_ffn_hidden_size=lang.moe and lang.moe.vision_ffn_hidden_size,
            layer_qk_norm_group=pgs.tp if lang.qk_norm and lang.qk_norm_type == "per_layer" else None),
        mtp_block_spec=mtp,
        routing_token_ids=routing_token_ids,
        loss_chunk_tokens=loss_chunk_tokens,
        vocab_size=padded_vocab_size(lang.vocab_size, pgs.tp.size()),
        true_vocab_size=lang.vocab_size,
        init_seed=init_seed,
        max_sequence_length=lang.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=lang.tie_word_embeddings,
        position_embedding_type=rope,
        rotary_base=lang.rope_theta,
        # the share of each head's channels 1-D RoPE rotates (Qwen3-Next's, MiniMax-M2's); a family's M-RoPE brings
        # its own rotary module (Qwen3.5's interleaved one)
        rotary_percent=lang.partial_rotary_factor if rope == "rope" else 1.0,
        # dynamic NTK scaling changes nothing up to max_position_embeddings, the longest row validate allows
        rope_scaling=lang.rope_scaling_factor is not None and lang.rope_scaling_type == "llama3",
        rope_scaling_factor=lang.rope_scaling_factor or 8.0,
        scatter_embedding_sequence_parallel=not takes_features,
        pg_collection=pgs,
        vp_stage=vp_stage,
    )


def _single_rank_group(cp_group: torch.distributed.ProcessGroup) -> torch.distributed.ProcessGroup:
    """A group of this rank alone (collective: every rank creates every rank's group); ``cp_group``
    itself where it already is one. megatron's attention and rotary code split a packed row over
    whatever CP group a module is built with, and an image is never split."""
    if cp_group.size() == 1:
        return cp_group
    own, _ = torch.distributed.new_subgroups(group_size=1)
    return own


def check_parallel_state(parallel_cfg: ParallelConfig, pgs: ProcessGroupCollection) -> None:
    for key, group in (("tensor_model_parallel_size", pgs.tp), ("pipeline_model_parallel_size", pgs.pp),
                       ("context_parallel_size", pgs.cp)):
        expected = getattr(parallel_cfg, key)
        if group is None or group.size() != expected:
            actual = None if group is None else group.size()
            raise ValueError(
                f"parallel.{key}={expected} but megatron's parallel state has {actual}; call "
                "megatron.core.parallel_state.initialize_model_parallel with the same sizes first"
            )


def check_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, packed_seq_params,
                 context_shard: Optional[ContextShard] = None) -> None:
    """input_ids [b, s]; position_ids [3, b, s]; packed (thd) input has b == 1 and cu_seqlens
    covering every position. Under context parallelism (``context_shard``) input_ids hold this CP
    rank's s / CP tokens while positions and cu_seqlens are the whole row's s."""
    batch, local_len = input_ids.shape
    seq_len = local_len if context_shard is None else context_shard.row_length
    if context_shard is not None and local_len * context_shard.size != seq_len:
        raise ValueError(f"input_ids hold {local_len} tokens, not 1/{context_shard.size} of the row's {seq_len}")
    if position_ids.dim() != 3 or position_ids.shape != (3, batch, seq_len):
        raise ValueError(
            f"position_ids must be [3, b, s] = [3, {batch}, {seq_len}], got {list(position_ids.shape)}"
        )
    if context_shard is not None and packed_seq_params is None:
        raise ValueError("context parallelism needs packed (thd) rows: packed_seq_params")
    if packed_seq_params is not None:
        if batch != 1:
            raise ValueError(f"packed (thd) input needs batch size 1, got {batch}")
        covered = int(packed_seq_params.cu_seqlens_q[-1])
        if covered != seq_len:
            # Rotary positions and the core attention index tokens by cu_seqlens: trailing padding
            # must be a segment of its own.
            raise ValueError(f"cu_seqlens_q[-1]={covered} must equal the sequence length {seq_len}")


def placeholder_count(input_ids: torch.Tensor, token_id: int, grid_thw: Optional[torch.Tensor], what: str,
                      merge_unit: int, num_features: Optional[int] = None) -> int:
    """Merged-patch count of the images (or videos) of ``grid_thw`` (``num_features``: the encoder's
    own count, where it packs features otherwise); must equal their placeholder tokens in
    ``input_ids`` (else a ValueError with both counts)."""
    num_tokens = int((input_ids == token_id).sum())
    if num_features is None:
        num_features = 0 if grid_thw is None else int(grid_thw.prod(-1).sum()) // merge_unit
    if num_tokens != num_features:
        grids = None if grid_thw is None else grid_thw.tolist()
        raise ValueError(
            f"input_ids hold {num_tokens} {what} tokens (id {token_id}) but the {what}s give "
            f"{num_features} merged patches ({what}_grid_thw={grids})"
        )
    return num_features


def single_rank_groups() -> ProcessGroupCollection:
    """megatron's groups, which must be of this rank alone (a TP = PP = CP = 1 layout): where a
    family's encoder runs on its own (``loongforge encode``)."""
    sizes = {"TP": parallel_state.get_tensor_model_parallel_world_size(),
             "PP": parallel_state.get_pipeline_model_parallel_world_size(),
             "CP": parallel_state.get_context_parallel_world_size()}
    if set(sizes.values()) != {1}:
        raise ValueError(f"build_encoder needs megatron's parallel state at TP = PP = CP = 1, got {sizes}")
    return ProcessGroupCollection.use_mpu_process_groups()
