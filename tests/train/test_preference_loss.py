"""Each preference loss equals TRL's own code on random log-probs (train.preference_loss).

TRL's losses are methods of its trainers; they are called here on stand-ins for the trainer (its
attributes) and, for DPOTrainer, for the model (the per-token log-probs it returns), so the numbers
compared are TRL 1.16's formulas and metric code themselves. Log-probs are float64; the inputs are
spread so that beta x margin crosses 1 (hinge's kink) and logsigmoid is far from linear: a wrong
sign, scale, normalisation or a missing term moves the loss by far more than the 1e-6 allowed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.kto_trainer import KTOTrainer

from loongforge.config.preference import PreferenceConfig
from loongforge.train.preference_loss import NllTerm, PairLogps, kto_loss, preference_loss

PAIRS, LENGTH = 6, 24
TOLERANCE = 1e-6
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


class OneProcessAccelerator:
    """What TRL's trainers ask of their ``accelerator``, for one process (test_preference_train.py uses it too)."""

    device = torch.device("cpu")

    @staticmethod
    def gather(value):
        return value

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(model):
        return model


def _batch(seed: int):
    """Per-token log-probs [2P, L-1] (chosen rows, then rejected) inside each row's completion, the
    completion masks [2P, L] (prompts of 3-8 tokens, answers of 2-15), and reference sums [2P]."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * PAIRS, LENGTH, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(3, 9, (1,), generator=generator))
        mask[row, start:start + int(torch.randint(2, 16, (1,), generator=generator))] = 1
    per_token = -torch.rand(2 * PAIRS, LENGTH - 1, generator=generator, dtype=torch.float64) * 3
    per_token = per_token * mask[:, 1:]  # [2P, L-1]: only the completion's tokens count
    # Reference sums off the policy's so that the margins d alternate in sign, |d| in [0.5, 6.5].
    sums = per_token.sum(1)
    chosen_offset = torch.rand(PAIRS, generator=generator, dtype=torch.float64) * 4
    signs = torch.tensor([1.0, -1.0] * (PAIRS // 2), dtype=torch.float64)
    margins = signs * (0.5 + 6 * torch.rand(PAIRS, generator=generator, dtype=torch.float64))
    ref = sums - torch.cat([chosen_offset, chosen_offset - margins])
    return per_token, mask, ref


def _ours(per_token, mask, ref, settings: PreferenceConfig, nll=None):
    sums, counts = per_token.sum(1), mask.sum(1)
    logps = PairLogps(chosen=sums[:PAIRS], rejected=sums[PAIRS:], chosen_tokens=counts[:PAIRS],
                      rejected_tokens=counts[PAIRS:], ref_chosen=None if ref is None else ref[:PAIRS],
                      ref_rejected=None if ref is None else ref[PAIRS:])
    if nll is None and settings.rpo_alpha:
        nll = NllTerm(loss_sum=-sums[:PAIRS].sum(), tokens=counts[:PAIRS].sum())
    return preference_loss(logps, settings, nll=nll)


def _trl_dpo(per_token, mask, ref, *, loss_types, loss_weights, beta):
    """DPOTrainer._compute_loss on a stand-in trainer and model: (loss, metrics)."""
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    model = SimpleNamespace(training=True)
    trainer = SimpleNamespace(
        model=model, accelerator=OneProcessAccelerator(), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=loss_types, loss_weights=loss_weights, beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, False)
    return float(loss), {name: trainer._metrics["train"][name][0] for name in METRICS}


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps):
    """TRL's metric lines (CPOTrainer / ORPOTrainer.get_batch_loss_metrics) over its reward tensors."""
    return {"rewards/chosen": float(chosen_rewards.mean()), "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "logps/chosen": float(chosen_logps.mean()), "logps/rejected": float(rejected_logps.mean())}


def _assert_close(ours, theirs, what):
    loss_gap = abs(float(ours.loss) - theirs[0])
    metrics = ours.metrics()
    metric_gap = max(abs(metrics[name] - theirs[1][name]) for name in theirs[1])
    print(f"{what}: loss {float(ours.loss):.6f} (TRL {theirs[0]:.6f}), |loss gap| {loss_gap:.1e}, "
          f"max |metric gap| {metric_gap:.1e}")
    assert loss_gap <= TOLERANCE and metric_gap <= TOLERANCE
    return metrics


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("rpo_alpha", [0.0, 0.7])
def test_reference_losses_equal_dpo_trainer(loss, rpo_alpha):
    """sigmoid, ipo, hinge (and + rpo_alpha x NLL, TRL's loss_type [loss, "sft"]) as DPOTrainer computes them."""
    per_token, mask, ref = _batch(seed=len(loss) + int(10 * rpo_alpha))
    settings = PreferenceConfig(loss=loss, beta=0.3, rpo_alpha=rpo_alpha)
    types, weights = ([loss, "sft"], [1.0, rpo_alpha]) if rpo_alpha else ([loss], [1.0])
    theirs = _trl_dpo(per_token, mask, ref, loss_types=types, loss_weights=weights, beta=0.3)
    ours = _ours(per_token, mask, ref, settings)
    metrics = _assert_close(ours, theirs, f"{loss} rpo_alpha={rpo_alpha}")
    assert 0 < metrics["rewards/accuracies"] < 1  # the strict > is exercised both ways
    if rpo_alpha:
        assert metrics["nll_loss"] > 0


def test_label_smoothing_is_the_conservative_sigmoid_of_cpo_trainer():
    """sigmoid with label_smoothing: CPOTrainer.cpo_loss's form on the logratios (cDPO)."""
    per_token, mask, ref = _batch(seed=7)
    settings = PreferenceConfig(loss="sigmoid", beta=0.3, label_smoothing=0.2)
    sums = per_token.sum(1)
    chosen_logratios, rejected_logratios = sums[:PAIRS] - ref[:PAIRS], sums[PAIRS:] - ref[PAIRS:]
    trainer = SimpleNamespace(alpha=0.0, beta=0.3, label_smoothing=0.2, loss_type="sigmoid", accelerator=OneProcessAccelerator())
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, chosen_logratios, rejected_logratios)
    theirs = (float(losses.mean()), _pair_metrics(chosen_rewards, rejected_rewards, sums[:PAIRS], sums[PAIRS:]))
    _assert_close(_ours(per_token, mask, ref, settings), theirs, "sigmoid label_smoothing=0.2")
    plain = _ours(per_token, mask, ref, PreferenceConfig(loss="sigmoid", beta=0.3))
    assert abs(float(plain.loss) - theirs[0]) > 100 * TOLERANCE  # smoothing changes the loss


@pytest.mark.parametrize("label_smoothing, rpo_alpha", [(0.0, 0.0), (0.15, 0.0), (0.0, 0.5)])
def test_simpo_equals_cpo_trainer(label_smoothing, rpo_alpha):
    """simpo: CPOTrainer.cpo_loss on token-averaged log-probs, + cpo_alpha x the chosen answers' NLL."""
    per_token, mask, ref = _batch(seed=11)
    settings = PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=label_smoothing,
                                rpo_alpha=rpo_alpha)
    sums, counts = per_token.sum(1), mask.sum(1)
    averages = sums / counts
    trainer = SimpleNamespace(alpha=0.0, beta=2.0, label_smoothing=label_smoothing, loss_type="simpo",
                              simpo_gamma=0.8, accelerator=OneProcessAccelerator())
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, averages[:PAIRS], averages[PAIRS:])
    nll = -sums[:PAIRS].sum() / counts[:PAIRS].sum()  # CPO's CrossEntropyLoss over the chosen answers' tokens
    theirs = (float(losses.mean() + rpo_alpha * nll),
              _pair_metrics(chosen_rewards, rejected_rewards, sums[:PAIRS], sums[PAIRS:]))
    ours = _ours(per_token, mask, None, settings)  # reference-free: no reference log-probs
    _assert_close(ours, theirs, f"simpo label_smoothing={label_smoothing} cpo_alpha={rpo_alpha}")


def test_orpo_equals_orpo_trainer():
    """orpo: the NLL over the chosen sequences minus ORPOTrainer.odds_ratio_loss's mean."""
    per_token, mask, ref = _batch(seed=13)
    settings = PreferenceConfig(loss="orpo", beta=0.25)
    sums, counts = per_token.sum(1), mask.sum(1)
    averages = sums / counts
    trainer = SimpleNamespace(beta=0.25, accelerator=OneProcessAccelerator())
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(trainer, averages[:PAIRS],
                                                                                 averages[PAIRS:])
    # The chosen sequences' NLL (prompt and answer): any token mean; here 40 tokens summing to 52.
    nll_sum, nll_tokens = torch.tensor(52.0, dtype=torch.float64), torch.tensor(40.0, dtype=torch.float64)
    theirs = (float(nll_sum / nll_tokens - losses.mean()),
              _pair_metrics(chosen_rewards, rejected_rewards, sums[:PAIRS], sums[PAIRS:]))
    ours = _ours(per_token, mask, None, settings, nll=NllTerm(loss_sum=nll_sum, tokens=nll_tokens))
    metrics = _assert_close(ours, theirs, "orpo")
    assert metrics["nll_loss"] == pytest.approx(1.3)


def test_dpo_at_equal_policy_and_reference_is_ln2_and_grad_pushes_chosen_up():
    """At policy == reference every pair's DPO loss is ln 2; its gradient raises the chosen log-prob and
    lowers the rejected one, by beta / 2 per pair / P."""
    chosen = torch.tensor([-5.0, -9.0], requires_grad=True)
    rejected = torch.tensor([-7.0, -4.0], requires_grad=True)
    logps = PairLogps(chosen=chosen, rejected=rejected, chosen_tokens=torch.tensor([3, 4]),
                      rejected_tokens=torch.tensor([2, 5]), ref_chosen=chosen.detach(), ref_rejected=rejected.detach())
    result = preference_loss(logps, PreferenceConfig(beta=0.5))
    result.loss.backward()
    print(f"DPO at the reference: loss {float(result.loss):.6f} (ln 2 = {math.log(2):.6f}), "
          f"d loss / d chosen {chosen.grad.tolist()}")
    assert float(result.loss) == pytest.approx(math.log(2), abs=1e-7)
    assert chosen.grad.tolist() == pytest.approx([-0.125, -0.125]) and rejected.grad.tolist() == pytest.approx([0.125, 0.125])
    assert result.metrics()["rewards/accuracies"] == 0.0  # equal rewards are not counted as correct


def test_step_denominators_make_micro_batch_losses_add_up_to_the_step_loss():
    """Split into micro-batches, each divided by the step's pair and NLL-token counts, the shares sum
    to the whole step's loss (what the step's reduction over micro-batches and ranks relies on)."""
    per_token, mask, ref = _batch(seed=17)
    settings = PreferenceConfig(loss="sigmoid", beta=0.3, rpo_alpha=0.5)
    whole = float(_ours(per_token, mask, ref, settings).loss)
    sums, counts = per_token.sum(1), mask.sum(1)
    shares = 0.0
    for part in (slice(0, 2), slice(2, PAIRS)):
        logps = PairLogps(chosen=sums[:PAIRS][part], rejected=sums[PAIRS:][part], chosen_tokens=counts[:PAIRS][part],
                          rejected_tokens=counts[PAIRS:][part], ref_chosen=ref[:PAIRS][part],
                          ref_rejected=ref[PAIRS:][part])
        nll = NllTerm(loss_sum=-sums[:PAIRS][part].sum(), tokens=counts[:PAIRS][part].sum())
        shares += float(preference_loss(logps, settings, nll=nll, step_pairs=PAIRS,
                                        step_nll_tokens=float(counts[:PAIRS].sum())).loss)
    assert abs(shares - whole) < 1e-12


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_kto_equals_kto_trainer(weights):
    """KTO on unpaired examples (5 desirable, 4 undesirable) with the mismatched pairs' KL estimate:
    KTOTrainer._compute_loss on a stand-in trainer and model, its weights applied."""
    generator = torch.Generator().manual_seed(19)
    count, length = 9, 20
    mask = torch.zeros(count, length, dtype=torch.long)
    mask[:, 6:6 + 10] = 1
    per_token = -torch.rand(count, length - 1, generator=generator, dtype=torch.float64) * 2 * mask[:, 1:]
    ref = per_token.sum(1) + torch.linspace(-3, 3, count, dtype=torch.float64)
    kl_logps = -torch.rand(count, generator=generator, dtype=torch.float64) * 20
    ref_kl_logps = kl_logps - 0.5 + torch.rand(count, generator=generator, dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=OneProcessAccelerator(), aux_loss_enabled=False,
        _compute_kl_logps=lambda model, batch: kl_logps, precompute_ref_logps=True, calculate_KL=True,
        loss_type="kto", beta=0.4, desirable_weight=weights[0], undesirable_weight=weights[1],
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    batch = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
             "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl_logps}
    theirs = float(KTOTrainer._compute_loss(trainer, lambda **_: outputs, batch, False))
    ours = kto_loss(per_token.sum(1), ref, labels, kl_logps, ref_kl_logps, beta=0.4, desirable_weight=weights[0],
                    undesirable_weight=weights[1])
    gaps = [abs(float(ours.loss) - theirs)] + [abs(ours.metrics[name] - trainer._metrics["train"][name][0])
                                               for name in ("kl", *METRICS) if name != "rewards/accuracies"]
    print(f"kto weights {weights}: loss {float(ours.loss):.6f} (TRL {theirs:.6f}), kl {ours.metrics['kl']:.4f}, "
          f"largest gap {max(gaps):.1e}")
    assert max(gaps) <= TOLERANCE and ours.metrics["kl"] > 0
