"""The ``preference`` section: preference training (DPO and its family) instead of SFT.

``preference: null`` (the default) trains by SFT. Any ``preference.*`` key switches ``loongforge
train`` to preference training on pairs (``loongforge.data.preference``), with the loss
``preference.loss`` names (``loongforge.train.preference_loss`` holds the formulas, TRL's). The
section checks itself (``problems``: one line per bad key, naming the fix).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Optional

PREFERENCE_KEY = "preference"
# TRL's loss names: DPOTrainer's sigmoid, ipo, hinge; CPOTrainer's simpo; ORPOTrainer's orpo.
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
# Losses on the policy's own (token-averaged) log-probs: no reference model is built or read.
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# The losses label smoothing has a meaning in (the conservative sigmoid form, cDPO).
SMOOTHED_LOSSES = ("sigmoid", "simpo")


@dataclass
class PreferenceConfig:
    """What preference training optimises; defaults are TRL's (DPOConfig, CPOConfig)."""

    KEY = PREFERENCE_KEY

    # One of PREFERENCE_LOSSES; sigmoid is DPO.
    loss: str = "sigmoid"
    # The KL strength (DPO's beta; IPO's tau; SimPO's and ORPO's reward scale). TRL's default.
    beta: float = 0.1
    # The reference model: an HF folder or a loongforge checkpoint folder, built with this run's
    # model.* settings. null: a frozen copy of the starting weights (under LoRA, the base with the
    # adapters switched off, no second copy). simpo and orpo use none.
    reference: Optional[str] = None
    # Weight of the chosen answers' NLL (token mean over the step) added to the loss (RPO; CPO's
    # cpo_alpha for simpo); 0: none. orpo adds its own NLL at weight 1.
    rpo_alpha: float = 0.0
    # SimPO's target reward margin gamma (CPOConfig's default 0.5); simpo only.
    simpo_gamma: float = 0.5
    # The probability that a pair's preference is flipped (cDPO's conservative loss), in [0, 0.5);
    # sigmoid and simpo only.
    label_smoothing: float = 0.0

    @property
    def uses_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE_LOSSES

    def problems(self) -> list[str]:
        key = self.KEY
        if self.loss not in PREFERENCE_LOSSES:
            close = difflib.get_close_matches(self.loss, PREFERENCE_LOSSES, n=1, cutoff=0.5)
            hint = f" did you mean '{close[0]}'?" if close else ""
            return [f"{key}.loss='{self.loss}' is not one of {' | '.join(PREFERENCE_LOSSES)};{hint} set {key}.loss "
                    f"to one of those (sigmoid is DPO)."]
        errors = []
        if not self.beta > 0:
            errors.append(f"{key}.beta={self.beta} must be positive (TRL's default is 0.1); set e.g. {key}.beta=0.1.")
        if not 0 <= self.label_smoothing < 0.5:
            errors.append(f"{key}.label_smoothing={self.label_smoothing} must be in [0, 0.5) (the probability a "
                          f"preference is flipped); set e.g. {key}.label_smoothing=0.1, or 0 for none.")
        elif self.label_smoothing and self.loss not in SMOOTHED_LOSSES:
            errors.append(f"{key}.label_smoothing={self.label_smoothing} applies to {' and '.join(SMOOTHED_LOSSES)} "
                          f"only, and {key}.loss={self.loss}; set {key}.label_smoothing=0.")
        if self.rpo_alpha < 0:
            errors.append(f"{key}.rpo_alpha={self.rpo_alpha} must not be negative (the NLL's weight; 0: none); "
                          f"set e.g. {key}.rpo_alpha=1.0.")
        elif self.rpo_alpha and self.loss == "orpo":
            errors.append(f"{key}.rpo_alpha={self.rpo_alpha} with {key}.loss=orpo: ORPO adds the chosen NLL at "
                          f"weight 1 itself; set {key}.rpo_alpha=0.")
        if self.simpo_gamma < 0:
            errors.append(f"{key}.simpo_gamma={self.simpo_gamma} must not be negative (SimPO's reward margin); "
                          f"set e.g. {key}.simpo_gamma=0.5.")
        if self.reference is not None and not self.uses_reference:
            errors.append(f"{key}.reference={self.reference} with {key}.loss={self.loss}, which is reference-free; "
                          f"set {key}.reference=null.")
        return errors
