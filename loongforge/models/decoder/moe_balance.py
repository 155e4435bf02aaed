"""Mixture-of-experts layers in training, for any family: the load-balancing loss (transformers' form
and megatron-core's, and the weight loongforge trains it at), routing statistics, tokens per expert.

Both start from the same two per-layer statistics of the router, over the T tokens of a batch and
the E experts of layer l (softmax probabilities p, the top-k experts chosen from them):

    f[l, e] = (tokens that chose expert e in layer l) / T        (sums to k over e)
    P[l, e] = (sum over tokens of p[t, e] in layer l) / T        (sums to 1 over e)

**transformers** (``load_balancing_loss_func``, Qwen3-MoE and Mixtral alike) averages each
statistic over the L layers first and takes one product:

    aux_hf = E * sum_e (1/L sum_l f[l, e]) * (1/L sum_l P[l, e])

and ``Qwen3MoeForCausalLM`` adds ``router_aux_loss_coef * aux_hf`` to the mean cross entropy, and
only when ``output_router_logits`` is true (false in the published configs, so a transformers
fine-tune of Qwen3-30B-A3B by default trains without it).

**megatron-core** (``switch_load_balancing_loss_func``, with ``moe_router_load_balancing_type
aux_loss``) takes the product in every layer, normalises the token fraction by k, and sums the
layers' losses, each injected as a gradient of its own (``MoEAuxLossAutoScaler``) rather than added
to the reported loss:

    aux_megatron = sum_l (E / k) * sum_e f[l, e] * P[l, e]

They are not a constant multiple of each other: transformers' form has the cross-layer terms
f[l, e] * P[m, e], l != m, and no 1/k. They agree only for one layer and k = 1. loongforge trains
with megatron-core's per-layer loss (``model.language.moe.aux_loss_coeff`` is its coefficient,
transformers' ``router_aux_loss_coef`` read as is); ``RouterStatistics`` records f and P from a
forward pass so both values can be computed and compared (tests check each against its library
to 1e-6).

How loongforge weighs it in training (``unscaled_balance_losses``, ``aux_loss_weight``,
``weighted_aux_loss``): the step's objective is

    sum(token losses) / (loss tokens) + coeff * mean over the step's micro-batches of aux_mb

over every micro-batch of the global batch (all data-parallel ranks), each aux_mb over the real
tokens of its row (padding is masked out of the router statistics: rows are padded differently at
each TP / PP layout). One micro-batch on one rank trains on ``CE + coeff * aux`` as transformers
does, and the objective does not depend on how rows are spread over ranks. It does depend on which
samples share a row, so data-parallel balancing (``balance.enabled``) deals such a model's rows whole
(``MoEConfig.loss_per_row``, ``balance.apply``) instead of packing the step's samples into rows of its own,
which trained another objective (Qwen2-MoE: the router's Adam moments 9.7e-4 from one process's). megatron-core's own
weighting under ``calculate_per_token_loss`` (the loongforge step) cannot give this: its routers
weigh each TP rank's share of the loss by that rank's token count, then ``finalize_model_grads``
divides by the loss tokens. So the routers attach their loss unscaled (megatron's other mode) and
the step multiplies the coefficient by (loss tokens / micro-batches) of the global batch, which the
gradient division turns into the plain mean.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist


def routers_of(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every megatron-core MoE router (``TopKRouter``) inside ``modules``."""
    # lazy: this module imports no megatron-core (train.metrics, on the launcher)
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]


def layer_statistics(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f [E], P [E]) of one layer from its router logits [T, E] (float32 softmax, as both do)."""
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs, topk, dim=-1).indices
    counts = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
    return counts / probs.shape[0], probs.mean(dim=0)


def transformers_balance_loss(statistics: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` value (without the coefficient) from every layer's
    (f, P): the product of the layer-averaged statistics."""
    fractions = torch.stack([f for f, _ in statistics]).mean(dim=0)
    probs = torch.stack([p for _, p in statistics]).mean(dim=0)
    return fractions.shape[0] * torch.sum(fractions * probs)


def megatron_balance_loss(statistics: list[tuple[torch.Tensor, torch.Tensor]], topk: int) -> torch.Tensor:
    """megatron-core's summed per-layer ``switch_load_balancing_loss_func`` (without the
    coefficient) from every layer's (f, P)."""
    return sum(f.shape[0] / topk * torch.sum(f * p) for f, p in statistics)


class RouterStatistics:
    """Per-layer (f, P) of every MoE router of a megatron model during ``record``: the routers'
    inputs are read by forward hooks and the logits recomputed from the router weights."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers_of([model])
        self.statistics: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _hook(self, router, inputs, output) -> None:
        hidden = inputs[0].detach().reshape(-1, router.weight.shape[1])
        logits = torch.nn.functional.linear(hidden.float(), router.weight.detach().float())
        self.statistics.append(layer_statistics(logits, router.topk))

    @contextmanager
    def record(self) -> Iterator["RouterStatistics"]:
        self.statistics = []
        handles = [router.register_forward_hook(self._hook) for router in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def routing_padding_mask(padding_mask: Optional[torch.Tensor], config, *, scattered_by_gpt_model: bool
                         ) -> Optional[torch.Tensor]:
    """The row's padding mask [b, s] (True at padding) as megatron-core's ``GPTModel`` hands it to
    its MoE layers, which leave those tokens out of the router statistics; None for a dense model.

    Under sequence parallelism each rank routes its slice of the sequence, so the mask must be cut
    the same way: ``GPTModel`` does that itself only when it embeds ``input_ids`` on the first stage
    (``scattered_by_gpt_model``); for a ``decoder_input`` built by the caller, or on a later
    pipeline stage, it is cut here."""
    if padding_mask is None or not getattr(config, "num_moe_experts", None):
        return None
    if config.sequence_parallel and not scattered_by_gpt_model:
        # lazy: this module imports no megatron-core (train.metrics, on the launcher)
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        padding_mask = scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1).contiguous())
        padding_mask = padding_mask.transpose(0, 1).contiguous()  # [b, s / tp]
    return padding_mask


def unscaled_balance_losses(model: torch.nn.Module) -> None:
    """Have every router of ``model`` attach its balance loss unscaled (megatron-core's mode without
    ``calculate_per_token_loss``, which routers copy when built), whatever the config says now."""
    for router in routers_of([model]):
        router.calculate_per_token_loss = False


def aux_loss_weight(loss_tokens: int, micro_batches: int) -> float:
    """Factor on megatron-core's aux-loss coefficient that gives the step objective above, from the
    global batch's loss tokens and micro-batches."""
    return max(loss_tokens, 1) / max(micro_batches, 1)


@contextmanager
def weighted_aux_loss(model_chunks: Sequence[torch.nn.Module], factor: float) -> Iterator[None]:
    """megatron-core's routers read ``config.moe_aux_loss_coeff`` at every forward (and log the
    loss divided by it, so logged values stay coefficient-free): scale it by ``factor`` for the
    duration of one step's forward and backward, then restore it."""
    with scaled_coefficient([router.config for router in routers_of(model_chunks)], "moe_aux_loss_coeff", factor):
        yield


@contextmanager
def scaled_coefficient(configs: Sequence[object], name: str, factor: float) -> Iterator[None]:
    """Each distinct config's loss coefficient ``name`` times ``factor`` until the block ends, then restored (a
    coefficient read at every forward: one step's weight of an auxiliary loss)."""
    distinct = {id(config): config for config in configs}
    saved = {key: getattr(config, name) for key, config in distinct.items()}
    for config in distinct.values():
        setattr(config, name, getattr(config, name) * factor)
    try:
        yield
    finally:
        for key, config in distinct.items():
            setattr(config, name, saved[key])


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to the experts over one step (global batch, real tokens only): the fewest and
    the most any expert of any layer received, and the worst layer's max / mean (1.0: even)."""

    tokens_min: int
    tokens_max: int
    max_over_mean: float


class ExpertLoadCounter:
    """Counts, on every rank, the tokens each router sends to each expert during training forwards,
    and sums them over all ranks once per step (``take``, a collective).

    ``num_layers`` counts every layer a router may sit in (the decoder's, then multi-token prediction's);
    the dense ones route nothing and are left out of the load. Each layer lives on one pipeline stage;
    sequence-parallel TP ranks route disjoint slices of a
    row and data-parallel (and expert-parallel) ranks disjoint rows, so the sum over the world
    counts every routed token once. Padding is left out (the router's padding mask). A forward
    without autograd is not counted: with activation recompute the first forward of a layer runs
    without it and its recomputation with it, so each micro-batch is counted once either way.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], *, num_layers: int, num_experts: int,
                 device: torch.device):
        # [layers (global index), experts]: this rank's counts; float64 holds exact integers
        # far beyond any step's token count.
        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self._handles = [router.register_forward_hook(self._count, with_kwargs=True)
                         for router in routers_of(model_chunks)]

    def _count(self, router, args, kwargs, output) -> None:
        if not torch.is_grad_enabled():
            return
        _, routing_map = output  # [tokens, experts] bool
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        if padding is not None:
            routing_map = routing_map[~padding.reshape(-1)]
        self._counts[router.layer_number - 1] += routing_map.sum(dim=0).double()

    def take(self) -> Optional[ExpertLoad]:
        """The step's load over all ranks (every rank must call it), then zero; None when nothing
        was routed."""
        counts = self._counts.clone()
        self._counts.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        if float(counts.sum()) == 0.0:
            return None
        counts = counts[counts.sum(dim=1) > 0]  # the sparse layers (DeepSeek's first layers are dense)
        means = counts.mean(dim=1).clamp(min=1e-12)  # [layers]
        return ExpertLoad(tokens_min=int(counts.min()), tokens_max=int(counts.max()),
                          max_over_mean=float((counts.max(dim=1).values / means).max()))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
