"""The LM head and its cross-entropy over a few tokens at a time (``training.loss_chunk_tokens``).

megatron-core's head writes the logits of every loss token at once, [n, V/tp] in the run's precision,
and its cross-entropy keeps an fp32 copy of them for the backward: at a 152k vocabulary a 16k-token row
is 9.9 GB of fp32 logits alone. ``chunked_cross_entropy`` projects ``chunk_tokens`` hidden states at a
time, keeps only each token's log-sum-exp (one float), and in the backward projects each chunk again and
turns it straight into that chunk's gradients (of the hidden states and of the head's weight): one
chunk's logits exist at a time. The price is the head's forward GEMM a second time in the backward.

The arithmetic is megatron's vocab-parallel cross-entropy (``tensor_parallel.vocab_parallel_cross_entropy``),
its order of operations included, so fp32 results agree to rounding: the logits in the weight's dtype cast
to fp32, the row max and then sum-exp and target logit all-reduced over the TP group (each rank holds a
contiguous 1/tp of the vocabulary), the vocabulary-padding ids (the last ones) out of the softmax as
``LanguageModel`` keeps them. The hidden states' gradient is this rank's vocabulary share: the caller
passes them through megatron's copy (or sequence-parallel gather) region, as ``ColumnParallelLinear`` does,
whose backward sums the shares over TP.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int,
                          true_vocab_size: int, tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-token loss [n] fp32 of ``labels`` [n] (vocabulary ids) under the head ``weight`` [V/tp, h] (this
    TP rank's rows: ids rank*V/tp ...) applied to ``hidden`` [n, h]; ``chunk_tokens`` tokens at a time.
    Ids from ``true_vocab_size`` on are vocabulary padding: no probability. Collective over ``tp_group``
    (every rank with the same ``n``)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"chunked_cross_entropy takes hidden [n, h], labels [n], weight [V/tp, h]; got "
                         f"{tuple(hidden.shape)}, {tuple(labels.shape)}, {tuple(weight.shape)}")
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, chunk_tokens, true_vocab_size, tp_group)


class _ChunkedCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, true_vocab_size, tp_group):
        shard = _Shard(weight, true_vocab_size, tp_group)
        loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [n]
        log_sum_exp = torch.empty_like(loss)  # [n]: all the backward keeps of the logits
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = shard.logits(hidden[rows])  # [c, V/tp] fp32
            row_max = logits.max(dim=-1).values  # [c]
            shard.all_reduce(row_max, dist.ReduceOp.MAX)
            logits.sub_(row_max[:, None])
            # One all-reduce for both sums: [2, c] = (the target's logit, sum of exp), each from the rank
            # holding it / its share of the vocabulary.
            target = shard.target_values(logits, labels[rows])  # [c], a copy: the exp below is in place
            sums = torch.stack([target, logits.exp_().sum(dim=-1)])
            shard.all_reduce(sums, dist.ReduceOp.SUM)
            loss[rows] = torch.log(sums[1]) - sums[0]
            log_sum_exp[rows] = row_max + torch.log(sums[1])
            del logits
        ctx.save_for_backward(hidden, weight, labels, log_sum_exp)
        ctx.chunk_tokens, ctx.true_vocab_size, ctx.tp_group = chunk_tokens, true_vocab_size, tp_group
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, log_sum_exp = ctx.saved_tensors
        shard = _Shard(weight, ctx.true_vocab_size, ctx.tp_group)
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]  # a frozen head (training.freeze_language) takes none
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None  # [n, h]: this rank's vocabulary share
        # The head's gradient summed over the chunks in fp32; with a bf16 weight each chunk's product is
        # rounded once, as megatron's single GEMM rounds its whole sum once.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            # d loss / d logits = (softmax - one-hot(target)) x the token's incoming gradient
            grad_logits = shard.logits(hidden[rows]).sub_(log_sum_exp[rows, None]).exp_()  # [c, V/tp] fp32
            shard.subtract_at_targets(grad_logits, labels[rows])
            grad_logits = grad_logits.mul_(grad_loss[rows, None].float()).to(hidden.dtype)
            if wants_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if wants_weight and grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            elif wants_weight:
                grad_weight.add_(grad_logits.t() @ hidden[rows])
            del grad_logits
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


class _Shard:
    """This TP rank's rows of the head: ids [first_id, first_id + V/tp), the ones from ``true_vocab_size``
    on padding."""

    def __init__(self, weight: torch.Tensor, true_vocab_size: int, tp_group: Optional[dist.ProcessGroup]):
        self.weight = weight  # [V/tp, h]
        self.group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        rank = 0 if self.group is None else self.group.rank()
        self.size = weight.shape[0]
        self.first_id = rank * self.size
        # padding ids are the vocabulary's last: on each rank a suffix of its rows
        self.real_rows = min(max(true_vocab_size - self.first_id, 0), self.size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[c, V/tp] fp32 of hidden [c, h], padding ids at -inf."""
        logits = (hidden @ self.weight.t()).float()
        if self.real_rows < self.size:
            logits[:, self.real_rows:] = float("-inf")
        return logits

    def _local(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows whose target this rank holds [k], their targets' columns [k])."""
        local = labels - self.first_id
        held = ((local >= 0) & (local < self.size)).nonzero(as_tuple=True)[0]
        return held, local[held]

    def target_values(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[c]: each row's target logit where this rank holds the target, else 0."""
        values = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
        held, columns = self._local(labels)
        values[held] = logits[held, columns]
        return values

    def subtract_at_targets(self, probabilities: torch.Tensor, labels: torch.Tensor) -> None:
        held, columns = self._local(labels)
        probabilities[held, columns] -= 1.0

    def all_reduce(self, tensor: torch.Tensor, op) -> None:
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
