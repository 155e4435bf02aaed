"""The language model every family builds: megatron-core's ``GPTModel`` with loongforge's head.

Three changes to ``GPTModel``, all family-independent: vocabulary-padding logits never enter the
softmax; with a ``loss_mask`` the LM head runs only on the positions whose loss counts; and with
``loss_chunk_tokens`` the head and its cross-entropy run a chunk of tokens at a time
(``decoder.chunked_loss``), the multi-token-prediction heads' too, so a row's logits are never whole.
Initial weights are keyed by (seed, name) so that every TP/PP layout starts from one model.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import get_pg_rank

from loongforge.config.schema import TrainingConfig
from loongforge.models.decoder.chunked_loss import chunked_cross_entropy
from loongforge.models.decoder.modality_balance import install_balance
from loongforge.models.decoder.modality_moe import install_routing_hooks, routing_tokens
from loongforge.models.layers import initialization


class LanguageModel(GPTModel):
    """``GPTModel`` whose loss ignores the vocabulary-padding logits.

    The output layer has ``padded_vocab_size`` rows; padded rows would still add ``exp(logit)`` to
    the softmax denominator, so their logits are set to -inf before the cross entropy.
    """

    def __init__(self, *args, true_vocab_size: int, init_seed: Optional[int] = None,
                 routing_token_ids: tuple[int, ...] = (),
                 loss_chunk_tokens: int = TrainingConfig.loss_chunk_tokens, **kwargs):
        # The embedding is GPTModel's first random draw; the decoder layers draw from keys of their
        # own (see the block spec) and leave this stream alone.
        with initialization.seeded(init_seed, "language_model.embedding"):
            super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        if loss_chunk_tokens < 0:
            raise ValueError(f"training.loss_chunk_tokens must be >= 0 (0: the whole logits), got {loss_chunk_tokens}")
        self.loss_chunk_tokens = loss_chunk_tokens
        # Modality-isolated experts (``decoder.modality_moe``): the ids routed to the vision experts, whose
        # positions every stage finds in its input ids and hands its layers as the block's context.
        self.register_buffer("routing_token_ids", torch.tensor(routing_token_ids, dtype=torch.long), persistent=False)
        if install_routing_hooks(self.decoder.layers if hasattr(self, "decoder") else []) and not routing_token_ids:
            raise ValueError("modality-isolated experts need routing_token_ids (the ids routed to the vision experts)")
        if routing_token_ids and hasattr(self, "decoder"):
            # Their load-balancing loss is transformers' over all sparse layers, not megatron-core's per layer
            # (on every stage of a modality-isolated model, also one without sparse layers: it relays the sums).
            install_balance(self.decoder, self.config, self.pg_collection)
        # megatron-core 0.16's MTP layers call their decoder layer without the padding mask, so an MoE router
        # there would count padding in its expert-bias load (and its balance statistics): hand it the mask the
        # decoder's layers route with.
        self._routing_padding: Optional[torch.Tensor] = None
        for layer in (self.mtp.layers if getattr(self, "mtp_process", False) else []):
            if hasattr(layer.transformer_layer.mlp, "router"):
                layer.transformer_layer.mlp.register_forward_pre_hook(self._mtp_padding_mask, with_kwargs=True)
        if kwargs.get("position_embedding_type") == "mrope":
            # Packed rows under context parallelism: megatron's thd rotary code (in attention) picks
            # every sample's chunks of this CP rank from the whole row's angles. M-RoPE's own cut along
            # the row (the unpacked convention) would hand it the wrong ones, so the angles stay whole.
            self.rotary_pos_emb.cp_group = None
        if (init_seed is not None and self.post_process and not self.share_embeddings_and_output_weights
                and initialization.draws_on_cpu(self.config)):
            # GPTModel drew it from the embedding's stream, which only a stage holding the embedding
            # had advanced: draw it again from a key of its own.
            initialization.redraw_sharded(
                self.output_layer.weight, (self.vocab_size, self.config.hidden_size),
                self.config.init_method, seed=init_seed, key="language_model.output_layer",
                tp_rank=get_pg_rank(self.pg_collection.tp), tp_size=self.pg_collection.tp.size())

    def forward(self, *args, padding_mask: Optional[torch.Tensor] = None, **kwargs):
        # For the MTP layers' routers: the mask as the decoder's layers receive it, [b, s], cut along the
        # sequence under sequence parallelism by GPTModel itself where it embeds the ids (the caller cuts it
        # where it hands in the embeddings, and on later stages).
        routing = padding_mask if getattr(self, "mtp_process", False) else None
        if (routing is not None and self.pre_process and self.config.sequence_parallel
                and kwargs.get("decoder_input") is None):
            routing = tensor_parallel.scatter_to_sequence_parallel_region(
                routing.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        self._routing_padding = routing
        if self.routing_token_ids.numel():
            block_kwargs = dict(kwargs.get("extra_block_kwargs") or {})
            if block_kwargs.get("context") is not None:
                raise ValueError("modality-isolated experts take the block's context for the tokens' modality; "
                                 "it holds another input (DeepStack's features)")
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            block_kwargs["context"] = routing_tokens(input_ids, self.routing_token_ids)
            kwargs["extra_block_kwargs"] = block_kwargs
        try:
            return super().forward(*args, padding_mask=padding_mask, **kwargs)
        finally:
            self._routing_padding = None

    def _mtp_padding_mask(self, module, args, kwargs):
        if kwargs.get("padding_mask") is None and self._routing_padding is not None:
            return args, {**kwargs, "padding_mask": self._routing_padding}
        return None

    def compute_language_model_loss(self, labels: torch.Tensor, logits) -> torch.Tensor:
        """Per-token loss [b, s] of labels [b, s]; ``logits`` [s, b, V/tp], or under ``_deferred_head``
        the head's input (``HeadInput``), whose loss is computed chunk by chunk."""
        if isinstance(logits, HeadInput):
            return self._chunked_loss(labels, logits)
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
        outside the mask. With ``loss_chunk_tokens`` the loss of every head (the MTP layers' too) is
        computed that many tokens at a time.
        """
        mtp = getattr(self, "mtp_process", False)
        if mtp and labels is None and self.post_process:
            # Logits alone: the multi-token-prediction layers predict nothing without labels (megatron would
            # clone the labels they train on); the main head's logits as without them. [s, b, h] -> [b, s, V/tp]
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            logits, _ = self.output_layer(hidden_states, weight=weight)
            return logits.transpose(0, 1).contiguous()
        if not self.post_process or labels is None or loss_mask is None or mtp:
            # With MTP layers: megatron's own head (every position) and theirs, each loss on the mask.
            chunked = self.post_process and labels is not None and self.loss_chunk_tokens
            with self._deferred_head() if chunked else nullcontext():
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
        picked_labels = labels.transpose(0, 1).reshape(-1)[picked].unsqueeze(0)  # [1, n]
        output_weight = self.shared_embedding_or_output_weight() if (
            self.share_embeddings_and_output_weights) else None
        if self.loss_chunk_tokens:
            head = HeadInput(picked_hidden, self.output_layer.weight if output_weight is None else output_weight,
                             sequence_parallel=False)  # already gathered above
            picked_loss = self._chunked_loss(picked_labels, head)  # [1, n]
        else:
            sequence_parallel = self.output_layer.sequence_parallel
            self.output_layer.sequence_parallel = False  # already gathered above
            try:
                logits, _ = self.output_layer(picked_hidden, weight=output_weight)  # [n, 1, V/tp]
            finally:
                self.output_layer.sequence_parallel = sequence_parallel
            picked_loss = self.compute_language_model_loss(picked_labels, logits)  # [1, n]
        loss = torch.zeros(seq_len * batch, dtype=picked_loss.dtype, device=picked_loss.device)
        loss = loss.index_put((picked,), picked_loss.reshape(-1))
        return loss.reshape(seq_len, batch).transpose(0, 1).contiguous()  # [b, s]

    @contextmanager
    def _deferred_head(self):
        """megatron's ``_postprocess`` with the output layer handing its input to
        ``compute_language_model_loss`` (a ``HeadInput``) in place of the logits: every head it runs
        (the main one, each MTP layer's) becomes a chunked loss, and its MTP bookkeeping stays megatron's."""
        layer = self.output_layer

        def defer(input_, weight=None, runtime_gather_output=None):
            return HeadInput(input_, layer.weight if weight is None else weight, layer.sequence_parallel), None

        layer.forward = defer
        try:
            yield
        finally:
            del layer.forward

    def _chunked_loss(self, labels: torch.Tensor, head: "HeadInput") -> torch.Tensor:
        """Per-token loss [b, s] of labels [b, s] (``decoder.chunked_loss``), the head's input entering
        the TP region as ``ColumnParallelLinear``'s does: gathered along the sequence under sequence
        parallelism (the backward reduce-scatters the ranks' vocabulary shares of its gradient), else
        copied (the backward all-reduces them)."""
        tp = self.pg_collection.tp
        if head.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(head.hidden, group=tp)  # [s, b, h]
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(head.hidden, group=tp)  # [s, b, h]
        seq_len, batch, width = hidden.shape
        loss = chunked_cross_entropy(
            hidden.reshape(seq_len * batch, width), head.weight, labels.transpose(0, 1).reshape(-1),
            chunk_tokens=self.loss_chunk_tokens, true_vocab_size=self.true_vocab_size, tp_group=tp)  # [s * b]
        return loss.reshape(seq_len, batch).transpose(0, 1).contiguous()


@dataclass(frozen=True)
class HeadInput:
    """What the output layer would project: hidden [s, b, h] (cut along s over TP where
    ``sequence_parallel``) and this TP rank's head weight [V/tp, h]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    sequence_parallel: bool
