"""DeepStack: vision features added to the hidden states after decoder layers 0..k-1.

Qwen3-VL passes the outputs of k intermediate vision blocks, each through a merger of its own, into
the language model: after decoder layer ``j`` (j < k), feature set ``j`` is added to the hidden
states at the image/video token positions.

How it rides through megatron's ``TransformerBlock`` unchanged: the k feature sets are laid out as
one dense tensor ``context`` [s, b, k, h] (zero at text positions, so adding it leaves text exact)
and handed to the block as its cross-attention ``context``, which every decoder layer receives and
returns untouched (the layers have no cross-attention). A forward hook on layer ``j`` adds
``context[:, :, j]`` to the layer's output. Being a block input, ``context``:

- follows the token layout of the hidden states: packed (thd) rows are [t, 1, ...] like them, and
  under sequence parallelism it is scattered along the sequence like the embeddings ([s/tp, b, k, h]);
- is an input of megatron's activation checkpoints, so a recomputed layer adds the same features
  and their gradient flows back to the vision tower;
- carries no state between calls: the hooks hold only their layer index.

Under pipeline parallelism the first stage must hold decoder layers 0..k-1 (``check_pipeline``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.vlm.vision_common import scatter_features


def dense_context(
    input_ids: torch.Tensor,
    token_features: list[tuple[int, list[torch.Tensor]]],
    shape: tuple[int, int, int],
) -> torch.Tensor:
    """[s, b, k, h]: for each (placeholder token id, k feature sets [n, h]) the features at that
    token's positions in (batch, position) order, zeros elsewhere. ``shape`` is (s, b, h)."""
    seq_len, batch, hidden = shape
    k = len(token_features[0][1])
    context = None
    for token_id, features in token_features:
        stacked = torch.stack(features, dim=1).reshape(-1, k * hidden)  # [n, k*h]
        if context is None:
            context = stacked.new_zeros(seq_len, batch, k * hidden)
        context = scatter_features(context, input_ids, token_id, stacked)
    return context.reshape(seq_len, batch, k, hidden)


def _add_deepstack(index: int):
    def hook(module, args, kwargs, output):
        context = kwargs.get("context")
        if context is None:
            return output
        hidden, context_out = output
        return hidden + context[:, :, index].to(hidden.dtype), context_out

    return hook


def install_hooks(layers: torch.nn.ModuleList, num_deepstack: int) -> None:
    """Hook the first ``num_deepstack`` decoder layers of this (first) pipeline stage."""
    if len(layers) < num_deepstack:
        raise ValueError(f"DeepStack adds vision features after decoder layers 0..{num_deepstack - 1}, "
                         f"but this stage holds {len(layers)} layers")
    for index in range(num_deepstack):
        layers[index].register_forward_hook(_add_deepstack(index), with_kwargs=True)


def _first_stage_layers(config: TransformerConfig, vp_stage: Optional[int]) -> int:
    """Decoder layers of pipeline rank 0's first (virtual) stage, asked from any rank.
    ``get_num_layers_to_build`` does not pass ``pp_rank`` on to a layout string, which then
    answers for the calling rank."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return layout.get_num_layers_to_build(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=0)
    return get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=0)


def check_pipeline(config: TransformerConfig, num_deepstack: int) -> None:
    """Every rank raises the same error when the first pipeline stage lacks a DeepStack layer."""
    vp_stage: Optional[int] = 0 if config.virtual_pipeline_model_parallel_size else None
    first_stage = _first_stage_layers(config, vp_stage)
    if first_stage < num_deepstack:
        raise ValueError(
            f"Qwen3-VL adds DeepStack features after decoder layers 0..{num_deepstack - 1} "
            f"({num_deepstack} = len(vision deepstack_visual_indexes)), so the first pipeline stage must "
            f"hold at least {num_deepstack} decoder layers; with "
            f"parallel.pipeline_model_parallel_size={config.pipeline_model_parallel_size} it holds "
            f"{first_stage}: use fewer pipeline stages"
        )
