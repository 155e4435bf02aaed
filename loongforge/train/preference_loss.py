"""Preference losses, as TRL defines them, from each side's summed log-probs.

Torch only (no megatron-core, no distributed calls): the training step hands in per-pair sums and
gets back the loss and TRL's metrics, so the same functions serve one process, every layout, and a
test against TRL itself (tests/train/test_preference_loss.py).

Inputs, per pair (each a tensor [P] over the P pairs of a micro-batch):

- ``chosen`` / ``rejected``: the policy's log-probs summed over the answer's tokens (every token
  after the generation prompt: the answer, its end-of-turn token, the template's trailing newline);
- ``chosen_tokens`` / ``rejected_tokens``: how many tokens those sums run over;
- ``ref_chosen`` / ``ref_rejected``: the same sums under the reference model (losses with one).

The losses (``preference.loss``), each TRL 1.16's formula, with logratio = policy - reference sum:

- ``sigmoid`` (DPO, ``DPOTrainer``): -log sigma(beta d), d = chosen logratio - rejected logratio;
  with ``label_smoothing`` eps the conservative form -(1-eps) log sigma(beta d) - eps log sigma(-beta d)
  (cDPO: TRL's ``CPOTrainer`` sigmoid and earlier ``DPOTrainer`` versions).
- ``ipo`` (``DPOTrainer``): (d' - 1/(2 beta))^2, d' the difference of the logratios each divided by
  its answer's token count (TRL length-normalises IPO; beta is the paper's tau).
- ``hinge`` (``DPOTrainer``): relu(1 - beta d).
- ``simpo`` (``CPOTrainer``, reference-free): the sigmoid form on the token-averaged log-probs,
  a = avg chosen - avg rejected - simpo_gamma / beta, with ``label_smoothing`` as above.
- ``orpo`` (``ORPOTrainer``, reference-free): NLL - beta log sigma(log odds), the log odds of the
  token-averaged log-probs p: (pc - pr) - (log(1 - e^pc) - log(1 - e^pr)); the NLL is the token mean
  over the chosen sequences' every predicted token, prompt included (TRL's ``chosen_nll_loss``).

``rpo_alpha`` adds rpo_alpha x NLL, the token mean of the chosen answers' negative log-probs over
the step (TRL's ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, rpo_alpha]``; ``CPOTrainer``'s
``cpo_alpha`` for simpo).

Metrics, TRL's names, each a mean over pairs: ``rewards/chosen`` (beta x logratio; reference-free
losses: beta x the token-averaged log-prob, as ``CPOTrainer`` and ``ORPOTrainer`` log it),
``rewards/rejected``, ``rewards/accuracies`` (chosen reward > rejected reward, strictly),
``rewards/margins``, ``logps/chosen`` and ``logps/rejected`` (the summed log-probs), and ``nll_loss``
where an NLL term is in the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from loongforge.config.preference import REFERENCE_FREE_LOSSES, PreferenceConfig

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")
NLL_METRIC = "nll_loss"


@dataclass
class PairLogps:
    """One micro-batch's pairs, each field a float tensor [P] (tokens: counts as floats or ints)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: Optional[torch.Tensor] = None
    ref_rejected: Optional[torch.Tensor] = None

    @property
    def num_pairs(self) -> int:
        return int(self.chosen.shape[0])


@dataclass
class NllTerm:
    """The NLL the loss adds (rpo_alpha, orpo): summed negative log-probs and the tokens they run over,
    for the micro-batch; the step's NLL is sum / tokens over the whole step (TRL's batch token mean)."""

    loss_sum: torch.Tensor  # scalar
    tokens: torch.Tensor  # scalar


@dataclass
class PreferenceLoss:
    """The micro-batch's share of the step's loss and its metric sums.

    ``loss``: sum over its pairs of the per-pair loss / the step's pairs, plus the NLL weight x its NLL
    sum / the step's NLL tokens: summed over the step's micro-batches and ranks it is the step's loss.
    ``metric_sums``: each PAIR_METRICS value summed over the pairs (detached), to be divided by the
    step's pairs; ``nll_sum`` / ``nll_tokens`` the NLL's parts (None without an NLL term)."""

    loss: torch.Tensor
    per_pair: torch.Tensor  # [P] the pair term of each pair, before the mean
    metric_sums: dict[str, torch.Tensor]
    num_pairs: int
    nll_sum: Optional[torch.Tensor] = None
    nll_tokens: Optional[torch.Tensor] = None

    def metrics(self) -> dict[str, float]:
        """The means over this micro-batch alone (the step divides by its own counts)."""
        means = {name: float(value) / max(self.num_pairs, 1) for name, value in self.metric_sums.items()}
        if self.nll_sum is not None:
            means[NLL_METRIC] = float(self.nll_sum) / max(float(self.nll_tokens), 1.0)
        return means


# ------------------------------------------------------------------------ the per-pair formulas


def conservative_sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """-(1-eps) log sigma(beta x) - eps log sigma(-beta x), per pair [P]; eps = 0 is DPO's loss."""
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def sigmoid_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, beta: float,
                 label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO: per pair [P]."""
    return conservative_sigmoid(chosen_logratios - rejected_logratios, beta, label_smoothing)


def hinge_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, beta: float) -> torch.Tensor:
    """SLiC's hinge: per pair [P]."""
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


def ipo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, chosen_tokens: torch.Tensor,
             rejected_tokens: torch.Tensor, *, beta: float) -> torch.Tensor:
    """IPO on logratios averaged per answer token (TRL's normalisation): per pair [P]."""
    delta = (chosen_logratios / chosen_tokens.clamp(min=1.0)) - (rejected_logratios / rejected_tokens.clamp(min=1.0))
    return (delta - 1 / (2 * beta)) ** 2


def simpo_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, *, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> torch.Tensor:
    """SimPO on token-averaged log-probs, the margin gamma / beta subtracted: per pair [P]."""
    return conservative_sigmoid(chosen_avg - rejected_avg - gamma / beta, beta, label_smoothing)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation: log1p(-e^x) below -ln 2, log(-expm1(x)) above."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor) -> torch.Tensor:
    """log(odds(chosen) / odds(rejected)), odds(p) = p / (1 - p), p the token-averaged probability: [P]."""
    chosen_avg, rejected_avg = chosen_avg.float(), rejected_avg.float()
    return (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))


def orpo_pair_loss(chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, *, beta: float) -> torch.Tensor:
    """ORPO's odds-ratio term, per pair [P] (the NLL is added once per step): -beta log sigma(log odds)."""
    return -beta * F.logsigmoid(orpo_log_odds(chosen_avg, rejected_avg))


# ------------------------------------------------------------------------ the step's loss


def pair_terms(logps: PairLogps, settings: PreferenceConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss [P], chosen rewards [P], rejected rewards [P]) of ``settings.loss``."""
    beta = settings.beta
    if settings.loss in REFERENCE_FREE_LOSSES:
        chosen_avg = logps.chosen / logps.chosen_tokens.clamp(min=1.0)
        rejected_avg = logps.rejected / logps.rejected_tokens.clamp(min=1.0)
        if settings.loss == "simpo":
            per_pair = simpo_loss(chosen_avg, rejected_avg, beta=beta, gamma=settings.simpo_gamma,
                                  label_smoothing=settings.label_smoothing)
        else:
            per_pair = orpo_pair_loss(chosen_avg, rejected_avg, beta=beta)
        return per_pair, beta * chosen_avg.detach(), beta * rejected_avg.detach()
    if logps.ref_chosen is None or logps.ref_rejected is None:
        raise ValueError(f"preference.loss={settings.loss} compares with a reference model, and no reference "
                         f"log-probs were given")
    chosen_logratios = logps.chosen - logps.ref_chosen
    rejected_logratios = logps.rejected - logps.ref_rejected
    if settings.loss == "sigmoid":
        per_pair = sigmoid_loss(chosen_logratios, rejected_logratios, beta=beta,
                                label_smoothing=settings.label_smoothing)
    elif settings.loss == "hinge":
        per_pair = hinge_loss(chosen_logratios, rejected_logratios, beta=beta)
    else:
        per_pair = ipo_loss(chosen_logratios, rejected_logratios, logps.chosen_tokens, logps.rejected_tokens,
                            beta=beta)
    return per_pair, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def nll_weight(settings: PreferenceConfig) -> float:
    """The NLL's weight in the loss: 1 for orpo, rpo_alpha (0: none) for the others."""
    return 1.0 if settings.loss == "orpo" else settings.rpo_alpha


def preference_loss(logps: PairLogps, settings: PreferenceConfig, *, nll: Optional[NllTerm] = None,
                    step_pairs: Optional[int] = None, step_nll_tokens: Optional[float] = None) -> PreferenceLoss:
    """The micro-batch's share of the step's loss (``PreferenceLoss.loss``) and its metric sums.

    ``nll``: the NLL's parts, needed where ``nll_weight`` is not 0 (the chosen answers' for rpo_alpha,
    the chosen sequences' for orpo). ``step_pairs`` / ``step_nll_tokens``: the step's counts over all
    micro-batches and ranks; None: this micro-batch's own (it is the whole step)."""
    per_pair, chosen_rewards, rejected_rewards = pair_terms(logps, settings)
    pairs = logps.num_pairs if step_pairs is None else step_pairs
    loss = per_pair.sum() / max(pairs, 1)
    weight = nll_weight(settings)
    nll_sum = nll_tokens = None
    if weight:
        if nll is None:
            raise ValueError(f"preference.loss={settings.loss} with rpo_alpha={settings.rpo_alpha} adds the chosen "
                             f"answers' NLL, and none was given")
        nll_sum, nll_tokens = nll.loss_sum, nll.tokens
        tokens = float(nll_tokens) if step_nll_tokens is None else step_nll_tokens
        loss = loss + weight * nll_sum / max(tokens, 1.0)
    metric_sums = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": logps.chosen.detach().sum(),
        "logps/rejected": logps.rejected.detach().sum(),
    }
    return PreferenceLoss(loss=loss, per_pair=per_pair, metric_sums=metric_sums, num_pairs=logps.num_pairs,
                          nll_sum=None if nll_sum is None else nll_sum.detach(),
                          nll_tokens=None if nll_tokens is None else nll_tokens)


# ------------------------------------------------------------------------ KTO (unpaired)


@dataclass
class KtoTerms:
    """KTO's loss over a batch of unpaired examples (TRL's ``KTOTrainer``, loss_type "kto"), and its metrics."""

    loss: torch.Tensor  # scalar: the mean over the examples of the weighted per-example losses
    kl: torch.Tensor  # scalar: the batch's KL estimate, detached, clamped at 0
    metrics: dict[str, float]


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl_logps: torch.Tensor,
             ref_kl_logps: torch.Tensor, *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> KtoTerms:
    """Eq. (7) of the KTO paper as TRL writes it. ``logps`` / ``ref_logps`` [N]: each example's summed
    completion log-probs under the policy and the reference; ``desirable`` bool [N] (``kto_tag``);
    ``kl_logps`` / ``ref_kl_logps`` [N]: the same for mismatched prompt/completion pairs, whose mean
    difference (no gradient, at least 0) is the reference point z0. Desirable examples lose
    1 - sigma(beta (logratio - z0)), undesirable ones 1 - sigma(beta (z0 - logratio)), weighted."""
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    logratios = logps - ref_logps  # [N]
    chosen, rejected = logratios[desirable], logratios[~desirable]
    losses = torch.cat([desirable_weight * (1 - torch.sigmoid(beta * (chosen - kl))),
                        undesirable_weight * (1 - torch.sigmoid(beta * (kl - rejected)))])
    metrics = {"kl": float(kl)}
    if len(chosen):
        metrics.update({"rewards/chosen": float(beta * chosen.detach().sum()) / len(chosen),
                        "logps/chosen": float(logps[desirable].detach().sum()) / len(chosen)})
    if len(rejected):
        metrics.update({"rewards/rejected": float(beta * rejected.detach().sum()) / len(rejected),
                        "logps/rejected": float(logps[~desirable].detach().sum()) / len(rejected)})
    if len(chosen) and len(rejected):
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return KtoTerms(loss=losses.mean(), kl=kl, metrics=metrics)
