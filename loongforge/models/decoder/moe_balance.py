"""The load-balancing loss of mixture-of-experts layers: transformers' form and megatron-core's.

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
with megatron-core's per-layer loss (``model.language.moe_aux_loss_coeff`` is its coefficient,
transformers' ``router_aux_loss_coef`` read as is); ``RouterStatistics`` records f and P from a
forward pass so both values can be computed and compared (tests check each against its library
to 1e-6).

Known scaling gap (not fixed yet): with ``calculate_per_token_loss`` (loongforge's training step),
megatron-core multiplies each layer's aux loss by the micro-batch's token count and
``finalize_model_grads`` divides every gradient by the global count of *loss* tokens. In
pre-training the two counts agree; in answer-masked fine-tuning the loss tokens are a fraction of
all tokens, so the load-balancing gradient is scaled up by (all tokens / loss tokens) relative to
``moe_aux_loss_coeff``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


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
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
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
