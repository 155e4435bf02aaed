"""Modality-isolated experts: one set of routed experts for text tokens, another for image and video tokens.

ERNIE-4.5-VL's sparse layers hold two megatron-core MoE layers side by side, each with its own router and
experts (the vision experts narrower), and one ungated shared expert every token runs through:

    out[text]   = text_moe(x[text])        (``moe.ffn_hidden_size`` wide experts)
    out[vision] = vision_moe(x[vision])    (``moe.vision_ffn_hidden_size`` wide experts)
    out        += shared_experts(x)        (``moe.shared_expert_ffn_hidden_size``)

Which tokens are vision tokens is a per-token fact of the input ids (the placeholders and the markers
around them, ``LanguageModel(routing_token_ids=...)``). It reaches the layers as the decoder block's
``context`` ([s, b] bool, the whole sequence also under sequence parallelism):
a block input, so it rides megatron's activation checkpoints (a recomputed layer routes the same
tokens) and every pipeline stage builds its own from the ids. A forward pre-hook on each layer hands
it to the layer's MLP for the length of the call.

Each expert set is a whole megatron MoE layer (router, token dispatcher, ``SequentialMLP`` experts), so
expert parallelism splits both sets over the EP group as it splits one; every rank runs both layers'
collectives, with no tokens of a modality as with some.

The router (``ScoreBiasRouter``): a softmax over the experts' logits (fp32); the top k chosen by the
softmax plus a per-expert bias (``expert_bias``, carried in checkpoints, not trained: ERNIE's
``e_score_correction_bias``); their softmax probabilities (without the bias) renormalised to sum to 1.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.models.layers.initialization import seeded_below

# The smallest sum the chosen probabilities are divided by (transformers' ``moe_norm_min``).
NORM_MIN = 1e-12


class ScoreBiasRouter(TopKRouter):
    """megatron's top-k router choosing by softmax + a fixed per-expert bias, weighing by the
    renormalised softmax alone. The bias is a row of its ``ModalityMoE``'s ``expert_bias`` (one tensor for
    both sets, as checkpoints store it), handed over by ``use_bias_row``; zeros until then."""

    def __init__(self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.__dict__["_bias_rows"] = None  # not a submodule or buffer: the owner's tensor
        self._bias_row = 0
        # transformers' load-balancing loss over every sparse layer (``modality_balance``), when trained with one.
        self.balance = None

    def use_bias_row(self, rows: torch.Tensor, row: int) -> None:
        self.__dict__["_bias_rows"], self._bias_row = rows, row

    @property
    def score_bias(self) -> torch.Tensor:
        rows = self.__dict__["_bias_rows"]
        return torch.zeros(self.config.num_moe_experts) if rows is None else rows[self._bias_row]

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """logits [s, b, E] -> (probs [s*b, E], zero outside each token's k experts; routing map [s*b, E])."""
        logits = logits.view(-1, self.config.num_moe_experts)
        scores = torch.softmax(logits.float(), dim=-1)
        if self.balance is not None:
            scores = self.balance.observe(scores, padding_mask, topk=self.topk, training=self.training,
                                          scale=self.config.moe_aux_loss_coeff)
        _, chosen = torch.topk(scores + self.score_bias.float().to(scores.device), self.topk, dim=-1)
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=NORM_MIN)
        probs = torch.zeros_like(scores).scatter(1, chosen, weights).type_as(logits)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
        return probs, routing_map


@dataclasses.dataclass
class ModalityMoESubmodules:
    text: ModuleSpec  # a megatron MoE layer (router, experts) for text tokens
    vision: ModuleSpec  # the same for image and video tokens, built at the vision experts' width
    shared_experts: Optional[ModuleSpec] = None  # an ungated SwiGLU every token runs through


class ModalityMoE(MegatronModule):
    """The MLP of a modality-isolated sparse layer (see the module docstring). ``vision_tokens`` ([s, b]
    bool, True at image/video tokens) is set by the layer's pre-hook (``install_routing_hooks``) for
    the length of each call."""

    # What a layer's spec built this class with (``modality_moe_spec``): megatron's TransformerLayer builds an
    # MLP given as a class with the config alone (one given as a ModuleSpec of a class it does not know is
    # built too, with a warning on the console).
    SUBMODULES: Optional[ModalityMoESubmodules] = None
    VISION_FFN_HIDDEN_SIZE: Optional[int] = None

    def __init__(self, config: TransformerConfig, submodules: Optional[ModalityMoESubmodules] = None, *,
                 vision_ffn_hidden_size: Optional[int] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        submodules = submodules or self.SUBMODULES
        vision_ffn_hidden_size = vision_ffn_hidden_size or self.VISION_FFN_HIDDEN_SIZE
        super().__init__(config=config)
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        routed = dataclasses.replace(config, moe_shared_expert_intermediate_size=None)
        with seeded_below("text_moe"):
            self.text_moe = build_module(submodules.text, config=routed, pg_collection=pg_collection)
        with seeded_below("vision_moe"):
            self.vision_moe = build_module(
                submodules.vision, config=dataclasses.replace(routed, moe_ffn_hidden_size=vision_ffn_hidden_size),
                pg_collection=pg_collection)
        self.shared_experts = None
        if submodules.shared_experts is not None:
            with seeded_below("shared_experts"):
                self.shared_experts = build_module(submodules.shared_experts, config=config, gate=False,
                                                   pg_collection=pg_collection)
        # Each set's routing bias, [text, vision] x experts (fp32, not trained; ERNIE's e_score_correction_bias).
        self.register_buffer("expert_bias", torch.zeros(2, config.num_moe_experts, dtype=torch.float32))
        for row, moe in enumerate((self.text_moe, self.vision_moe)):
            moe.router.use_bias_row(self.expert_bias, row)
        self.vision_tokens: Optional[torch.Tensor] = None  # [s, b]: the TP group's whole sequence
        self.tp_group = pg_collection.tp

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() replace the buffer: hand the routers the new tensor.
        result = super()._apply(fn, *args, **kwargs)
        for row, moe in enumerate((self.text_moe, self.vision_moe)):
            moe.router.use_bias_row(self.expert_bias, row)
        return result

    def set_layer_number(self, layer_number: int) -> None:
        for moe in (self.text_moe, self.vision_moe):
            moe.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [s, b, h] (this rank's s / tp under sequence parallelism); padding_mask [b, s] (True:
        padding; [b, s / tp] likewise) -> (output like hidden_states, None).

        Under sequence parallelism the modalities split the TP group's whole sequence, not each rank's slice
        (each slice holds its own count of each): the hidden states are gathered, each modality's tokens
        padded to a multiple of the TP size and cut evenly over the group as megatron's MoE layer takes them,
        its outputs gathered and this rank's slice kept."""
        tp = self.tp_group
        split = self.config.sequence_parallel and tp.size() > 1
        whole = gather_from_sequence_parallel_region(hidden_states, group=tp) if split else hidden_states
        if padding_mask is not None and split:
            padding_mask = torch.cat(_all_gather(padding_mask.transpose(0, 1).contiguous(), tp)).transpose(0, 1)
        seq_len, batch, hidden = whole.shape
        if self.vision_tokens is None:
            raise RuntimeError("modality-isolated experts need the tokens' modality: build the language model "
                               "with routing_token_ids (the decoder hands it to every layer)")
        if tuple(self.vision_tokens.shape) != (seq_len, batch):
            raise ValueError(f"the tokens' modality is {list(self.vision_tokens.shape)}, the hidden states "
                             f"[{seq_len}, {batch}, {hidden}]")
        flat = whole.reshape(-1, hidden)
        vision = self.vision_tokens.reshape(-1)
        padding = None if padding_mask is None else padding_mask.transpose(0, 1).reshape(-1)
        output = torch.zeros_like(flat)
        for moe, rows in ((self.text_moe, (~vision).nonzero().squeeze(1)), (self.vision_moe, vision.nonzero().squeeze(1))):
            part = self._expert_set(moe, flat.index_select(0, rows), None if padding is None else padding[rows], split)
            output = output.index_copy(0, rows, part.to(output.dtype))
        output = output.view(seq_len, batch, hidden)
        if split:
            output = scatter_to_sequence_parallel_region(output, group=tp)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output, None

    def _expert_set(self, moe, tokens: torch.Tensor, padding: Optional[torch.Tensor], split: bool) -> torch.Tensor:
        """One modality's tokens [n, h] (their padding [n] or None) through its MoE layer -> [n, h]; ``split``:
        the TP group's tokens, cut evenly over it (padded with rows the routers count as padding)."""
        if not split:
            out, _ = moe(tokens.unsqueeze(1), padding_mask=None if padding is None else padding.unsqueeze(0))
            return out.reshape(-1, tokens.shape[-1])
        tp, count = self.tp_group, tokens.shape[0]
        size = -(-count // tp.size()) * tp.size()
        filler = size - count
        tokens = torch.cat([tokens, tokens.new_zeros(filler, tokens.shape[-1])])
        padding = torch.cat([padding if padding is not None else torch.zeros(count, dtype=torch.bool, device=tokens.device),
                             torch.ones(filler, dtype=torch.bool, device=tokens.device)])
        share = size // tp.size()
        mine = slice(tp.rank() * share, (tp.rank() + 1) * share)
        out, _ = moe(tokens[mine].unsqueeze(1), padding_mask=padding[mine].unsqueeze(0))
        return gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=tp)[:count, 0]


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(parts, tensor, group=group)
    return parts


def modality_moe_spec(text: ModuleSpec, vision: ModuleSpec, shared: Optional[ModuleSpec],
                      vision_ffn_hidden_size: int) -> type[ModalityMoE]:
    """The sparse layers' MLP, as a ``ModalityMoE`` class holding its submodules: ``text`` and ``vision``
    megatron MoE layer specs (their routers' module swapped for ``ScoreBiasRouter``), ``shared`` a
    ``SharedExpertMLP`` spec or None."""
    def with_router(spec: ModuleSpec) -> ModuleSpec:
        return ModuleSpec(module=spec.module, submodules=dataclasses.replace(spec.submodules, router=ScoreBiasRouter,
                                                                             shared_experts=None))

    submodules = ModalityMoESubmodules(text=with_router(text), vision=with_router(vision), shared_experts=shared)
    return type("ModalityMoE", (ModalityMoE,), {"SUBMODULES": submodules,
                                                "VISION_FFN_HIDDEN_SIZE": vision_ffn_hidden_size})


def routing_tokens(input_ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[s, b] bool: True where ``input_ids`` [b, s] is one of ``token_ids`` (routed to the vision experts); the
    whole sequence also under sequence parallelism (the layers split it by modality over the TP group)."""
    return torch.isin(input_ids, token_ids.to(input_ids.device)).transpose(0, 1).contiguous()


def _hand_modality(module, args, kwargs):
    module.mlp.vision_tokens = kwargs.get("context")


def _take_modality_back(module, args, kwargs, output):
    module.mlp.vision_tokens = None


def install_routing_hooks(layers) -> int:
    """Hook every layer (of ``layers``) whose MLP is a ``ModalityMoE``; returns how many."""
    hooked = 0
    for layer in layers:
        if isinstance(layer.mlp, ModalityMoE):
            layer.register_forward_pre_hook(_hand_modality, with_kwargs=True)
            layer.register_forward_hook(_take_modality_back, with_kwargs=True)
            hooked += 1
    return hooked
