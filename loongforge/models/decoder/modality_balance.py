"""transformers' load-balancing loss for modality-isolated experts (``modality_moe``), over every sparse layer of
the model at once, at any TP / CP / EP / PP layout and with activation recompute.

transformers (``load_balancing_loss_func`` over the model's router logits) puts each sparse layer's text and
vision router logits in one [T, E] tensor (text tokens' rows from the text router, vision tokens' rows from the
vision router: text expert e and vision expert e share bin e) and, over the L sparse layers and the T real
tokens of the row, with p = softmax(logits) and ``chosen`` its top k (no expert bias in either):

    f[e] = (times e was chosen) / (L T)       P[e] = (sum of p[., e]) / (L T)       aux = E sum_e f[e] P[e]

(``moe_balance`` has why this is not megatron-core's per-layer loss). The loss is linear in every layer's p
with the detached, global f as coefficient: d aux / d p[l, t, e] = E f[e] / (L T). So each router attaches
an autograd node to its probabilities (``_BalanceGradient``, as megatron-core's ``MoEAuxLossAutoScaler``
does) whose backward adds ``coeff * E f / (L T)`` on the real rows, read from this rank's ``ModalityBalance``
when the backward runs; the coefficient is the routers' ``moe_aux_loss_coeff`` at the forward (the step
scales it: ``moe_balance.weighted_aux_loss``).

f needs the counts of every layer, also those of later pipeline stages. Per micro-batch:

- forward: the decoder block's pre-hook opens the statistics (a training forward with autograd on); every
  router adds its counts, probability sums and real tokens (only outside the backward: a recomputed layer
  counted in its first forward); the block's hook sums them over the ranks routing other tokens of the same
  rows (the TP group where the modalities are split over it, the CP group) and chains them along the
  pipeline on a process group of their own: stage s receives stage s-1's sums (sent at the end of its forward
  of the same micro-batch, before megatron sent its activations), adds its own and sends them to s+1; the
  last stage holds them all, computes the gradient coefficient E f / (L T), logs aux in megatron-core's MoE
  loss tracker and sends the coefficient back to s-1 on a second group.
- backward: a hook on the block's output gradient (the first thing a stage's backward computes) sets the
  micro-batch's coefficient before any router's node runs: the last stage's own (kept by the hook), another
  stage's received from s+1 and passed on to s-1. Under 1F1B micro-batches run in order both ways, so the
  messages arrive in the order they are awaited. Interleaved pipelines are refused (``config.validate``): a
  rank's model chunks would chain through one another.

Evaluation (``model.eval()`` without autograd) counts, attaches and sends nothing.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils

from loongforge.models.decoder.modality_moe import ModalityMoE

# megatron-core's tracker entry the step logs as its load-balancing loss (``train.step``).
TRACKER_NAME = "load_balancing_loss"


def _in_backward() -> bool:
    """Inside an autograd backward (megatron's activation recompute re-runs a layer there)."""
    return torch._C._current_graph_task_id() != -1


class _BalanceGradient(torch.autograd.Function):
    """Identity on a router's probabilities [n, E]; its backward adds ``scale`` x the micro-batch's
    coefficient [E] on the real rows ([n] float, 0 at padding)."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, real: torch.Tensor, balance: "ModalityBalance", scale: float):
        ctx.save_for_backward(real)
        ctx.balance, ctx.scale = balance, scale
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (real,) = ctx.saved_tensors
        coefficient = ctx.balance.coefficient().to(grad.dtype)  # [E]
        return grad + ctx.scale * real[:, None].to(grad.dtype) * coefficient[None, :], None, None, None


class _PipelineChain:
    """The statistics forward and the coefficient back between neighbouring pipeline stages, each way on a
    process group of its own (never mixed with megatron's activation messages)."""

    def __init__(self, pipeline: dist.ProcessGroup, forward_group: dist.ProcessGroup,
                 backward_group: dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(pipeline)
        self.stage, self.stages = pipeline.rank(), pipeline.size()
        self.previous = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage < self.stages - 1 else None
        self.forward_group, self.backward_group = forward_group, backward_group
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []  # kept alive until delivered

    def _send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
        self._sending = [(work, t) for work, t in self._sending if not work.is_completed()]
        self._sending.append((dist.isend(tensor, dst, group=group), tensor))

    def gather(self, mine: torch.Tensor) -> Optional[torch.Tensor]:
        """This stage's sums plus every earlier stage's; passed on, and returned on the last stage alone."""
        if self.previous is not None:
            earlier = torch.empty_like(mine)
            dist.recv(earlier, self.previous, group=self.forward_group)
            mine = mine + earlier
        if self.next is not None:
            self._send(mine, self.next, self.forward_group)
            return None
        return mine

    def send_back(self, coefficient: torch.Tensor) -> None:
        if self.previous is not None:
            self._send(coefficient, self.previous, self.backward_group)

    def receive_back(self, like: torch.Tensor) -> torch.Tensor:
        coefficient = torch.empty_like(like)
        dist.recv(coefficient, self.next, group=self.backward_group)
        self.send_back(coefficient)
        return coefficient


class ModalityBalance:
    """One rank's part of the loss for its decoder (see the module docstring)."""

    def __init__(self, num_experts: int, *, sum_groups: list[dist.ProcessGroup], chain: Optional[_PipelineChain],
                 tracker_layers: int, average_group: Optional[dist.ProcessGroup]):
        self.num_experts = num_experts
        self._sum_groups = sum_groups  # ranks routing other tokens of the same rows
        self._chain = chain
        self._tracker_layers, self._average_group = tracker_layers, average_group
        # [counts E, probability sums E, real tokens 1] (float64: exact counts) while a training forward is open
        self._sums: Optional[torch.Tensor] = None
        self._current: Optional[torch.Tensor] = None  # [E]: the coefficient of the micro-batch in backward

    def coefficient(self) -> torch.Tensor:
        if self._current is None:
            raise RuntimeError("a modality-isolated router's balance gradient ran before its micro-batch's "
                               "statistics reached this stage")
        return self._current

    def observe(self, probs: torch.Tensor, padding: Optional[torch.Tensor], *, topk: int, training: bool,
                scale: float) -> torch.Tensor:
        """A router's softmax probabilities [n, E] (fp32; padding [n] True at padding, or None) -> the same,
        with the balance gradient attached where this forward builds the graph."""
        real = (torch.ones(probs.shape[0], device=probs.device) if padding is None
                else (~padding.reshape(-1)).float())  # [n]
        if self._sums is not None and not _in_backward():
            detached = probs.detach()
            chosen = torch.topk(detached, topk, dim=-1).indices  # [n, k]
            counts = torch.zeros(self.num_experts, dtype=torch.float64, device=probs.device)
            counts.scatter_add_(0, chosen.reshape(-1), real.double().repeat_interleave(topk))
            sums = (detached.double() * real.double()[:, None]).sum(dim=0)
            self._sums += torch.cat([counts, sums, real.double().sum().reshape(1)]).to(self._sums.device)
        if training and torch.is_grad_enabled() and probs.requires_grad and scale:
            probs = _BalanceGradient.apply(probs, real, self, scale)
        return probs

    def open(self, block, args, kwargs) -> None:
        """The decoder block's forward begins: a training forward with autograd counts."""
        self._sums = None
        if block.training and torch.is_grad_enabled() and not _in_backward():
            device = next(block.parameters()).device
            self._sums = torch.zeros(2 * self.num_experts + 1, dtype=torch.float64, device=device)

    def close(self, block, args, kwargs, output) -> None:
        """The block's forward ends (``output`` its hidden states): sum, chain, keep the coefficient."""
        if self._sums is None:
            return
        sums, self._sums = self._sums, None
        for group in self._sum_groups:
            dist.all_reduce(sums, group=group)
        hidden = output[0] if isinstance(output, tuple) else output
        coefficient = None
        if self._chain is not None:
            sums = self._chain.gather(sums)
        if sums is None:  # an earlier stage: its tracker entry (zero) joins the step's sum over the stages
            self._track(torch.zeros((), device=hidden.device))
        else:  # the last stage: every layer's counts
            coefficient = self._finish(sums)
            if self._chain is not None:
                self._chain.send_back(coefficient)
        if hidden.requires_grad:
            hidden.register_hook(partial(self._backward_begins, coefficient))

    def _finish(self, sums: torch.Tensor) -> torch.Tensor:
        """The coefficient E f / (L T) [E] from the sums; aux into megatron-core's tracker."""
        experts = self.num_experts
        tokens = sums[-1].clamp(min=1.0)  # L T
        fractions, probs = sums[:experts] / tokens, sums[experts:2 * experts] / tokens
        self._track(experts * torch.sum(fractions * probs))
        return (experts * fractions / tokens).float()

    def _track(self, aux: torch.Tensor) -> None:
        """aux in the tracker slot of the model's last layer (summed over the pipeline stages, averaged over
        the data-parallel replicas, divided by the micro-batches: ``train.step``)."""
        moe_utils.save_to_aux_losses_tracker(TRACKER_NAME, aux.float(), self._tracker_layers, self._tracker_layers,
                                             avg_group=self._average_group)

    def _backward_begins(self, coefficient: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        """The stage's backward of a micro-batch begins (its output's gradient): the last stage's own
        coefficient, or the one the next stage sends (passed on to the previous)."""
        if coefficient is None:
            coefficient = self._chain.receive_back(torch.empty(self.num_experts, device=grad.device))
        self._current = coefficient


def _pipeline_groups(pipeline: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two new groups of this rank's pipeline ranks (forward, backward); every rank creates every pipeline's
    pair in one order (``new_group`` is collective over the world)."""
    mine = tuple(dist.get_process_group_ranks(pipeline))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    pair = None
    for ranks in sorted(set(map(tuple, everyone))):
        groups = (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
        if ranks == mine:
            pair = groups
    return pair


def install_balance(decoder, config, pg_collection) -> Optional[ModalityBalance]:
    """transformers' balance loss on ``decoder``'s modality-isolated routers (a megatron ``TransformerBlock``
    with ``config.moe_aux_loss_coeff`` > 0; on every pipeline stage of such a model, the stages without sparse
    layers included: a collective when the pipeline has several stages)."""
    if not config.moe_aux_loss_coeff:
        return None
    pipeline = pg_collection.pp
    chain = _PipelineChain(pipeline, *_pipeline_groups(pipeline)) if pipeline.size() > 1 else None
    split = config.sequence_parallel and pg_collection.tp.size() > 1  # ModalityMoE splits the modalities over TP
    sum_groups = ([pg_collection.tp] if split else []) + ([pg_collection.cp] if pg_collection.cp.size() > 1 else [])
    average = getattr(pg_collection, "dp_cp", None) or parallel_state.get_data_parallel_group(with_context_parallel=True)
    balance = ModalityBalance(config.num_moe_experts, sum_groups=sum_groups, chain=chain,
                              tracker_layers=config.num_layers, average_group=average)
    for layer in decoder.layers:
        if isinstance(layer.mlp, ModalityMoE):
            for moe in (layer.mlp.text_moe, layer.mlp.vision_moe):
                moe.router.balance = balance
    decoder.register_forward_pre_hook(balance.open, with_kwargs=True)
    decoder.register_forward_hook(balance.close, with_kwargs=True)
    return balance
