"""The compute-cost model shared by ``fit-cost``, the load balancer and ``bench balance``.

One micro-batch's forward+backward time on one rank is modelled as

    t = a * sum L^2 + b * sum L + c * N + d * sum P^2 + e * sum P + f * n_img + g * n_loss

over its samples (L: a sample's language-model tokens, text and merged image tokens included) and
its images/videos (P: one image's or video's vision patches before the 2x2 merge). The quadratic
terms are attention (causal over each packed sample in the LLM; over each image in the ViT's
full-attention blocks), the linear terms are the matmuls, N and n_img are per-sample and per-image
overheads, and n_loss counts the tokens the loss is computed on: the LM head (vocabulary x hidden
GEMM, softmax, cross-entropy) runs on those only, so a sample's cost depends on its answer share
(most of a small model's cost with a 152k vocabulary; ~7% of the matmuls at 7B). Everything is in
seconds; coefficients are non-negative. ``context_parallel_row_seconds`` prices one rank's share
of a row split over context-parallel ranks.

This module is pure Python + numpy: the planner runs in data-loading threads and in simulations.
"""

from __future__ import annotations

import dataclasses

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from loongforge.parallel.media_assign import VisionCost, deal, frame_costs

COST_FORMAT = "loongforge-cost/1"

# Order of the features and coefficients everywhere (profiles, fits, COST.json).
TERMS = ("sum_L2", "sum_L", "N", "sum_P2", "sum_P", "n_img", "n_loss")
# The terms that price the vision encoder's work; the others price the language model's.
VISION_TERMS = ("sum_P2", "sum_P", "n_img")
LANGUAGE_TERMS = tuple(term for term in TERMS if term not in VISION_TERMS)
# Under context parallelism a rank holds 1/CP of every sample's tokens: chunks r and 2CP-1-r, whose
# causal attention work adds up to 1/CP of the sample's too (megatron-core's load-balanced layout).
# N, a per-sample overhead, is paid whole on every rank: each holds a piece of every sample.
CONTEXT_SPLIT_TERMS = ("sum_L2", "sum_L", "n_loss")
TERM_DESCRIPTIONS = {
    "sum_L2": "sum over samples of L^2, L = the sample's language-model tokens",
    "sum_L": "sum over samples of L",
    "N": "number of samples",
    "sum_P2": "sum over images/videos of P^2, P = vision patches of one image before merging",
    "sum_P": "sum over images/videos of P",
    "n_img": "number of images and videos",
    "n_loss": "number of tokens with loss (the LM head and cross-entropy run on these only)",
}
# Terms a COST.json may lack (written before the term existed): read as 0.
_OPTIONAL_TERMS = ("n_loss",)


@dataclass(frozen=True)
class SampleCost:
    """What the cost model needs to know about one sample."""

    tokens: int  # L
    patches: tuple[int, ...] = ()  # P of each image / video in the sample
    loss_tokens: int = 0  # tokens of this sample the loss is computed on
    # (t, h, w) patch grid of each image / video, where known (a micro-batch's, not a planner's
    # size estimate): the model-FLOP count needs the shape, not only P = t * h * w.
    grids: tuple[tuple[int, int, int], ...] = ()

    def features(self) -> np.ndarray:
        """This sample's contribution to each term, in ``TERMS`` order: shape [7]."""
        p = np.asarray(self.patches, dtype=np.float64)
        return np.array([float(self.tokens) ** 2, float(self.tokens), 1.0,
                         float((p * p).sum()), float(p.sum()), float(len(p)), float(self.loss_tokens)])


def batch_features(samples: Iterable[SampleCost]) -> np.ndarray:
    """Aggregated features of a micro-batch: shape [7]."""
    total = np.zeros(len(TERMS))
    for sample in samples:
        total += sample.features()
    return total


@dataclass
class CostModel:
    coefficients: dict[str, float]
    units: str = "seconds"
    source: str = "default"  # "default", "flops", "fit:nnls", "fit:smoothmax", "tokens"
    environment: dict = field(default_factory=dict)
    accuracy: dict = field(default_factory=dict)
    # Fixed seconds per micro-batch (launches, embedding-gradient accumulation, Python); the same on
    # every rank for equal micro-batch counts, so it never changes a plan, only absolute predictions.
    micro_batch_overhead_s: float = 0.0

    def __post_init__(self):
        missing = [t for t in TERMS if t not in self.coefficients]
        if missing:
            raise ValueError(f"cost model is missing coefficients {missing}; expected {list(TERMS)}")
        bad = {k: v for k, v in self.coefficients.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"cost model coefficients must be finite and >= 0, got {bad}")
        if not (math.isfinite(self.micro_batch_overhead_s) and self.micro_batch_overhead_s >= 0):
            raise ValueError(f"micro_batch_overhead_s must be finite and >= 0, got "
                             f"{self.micro_batch_overhead_s}")

    @property
    def vector(self) -> np.ndarray:
        return np.array([self.coefficients[t] for t in TERMS], dtype=np.float64)

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """features [..., 7] -> predicted seconds [...]."""
        return np.asarray(features, dtype=np.float64) @ self.vector

    def predict_micro_batch(self, features: np.ndarray) -> np.ndarray:
        """Aggregated micro-batch features [..., 7] -> predicted forward+backward seconds [...]."""
        return self.predict_features(features) + self.micro_batch_overhead_s

    def sample_cost(self, sample: SampleCost) -> float:
        return float(self.predict_features(sample.features()))

    def sample_costs(self, tokens: Sequence[int], patches: Sequence[Sequence[int]],
                     loss_tokens: Optional[Sequence[int]] = None) -> np.ndarray:
        """Vectorised per-sample cost: tokens [n], patches (n lists), loss tokens [n] -> seconds [n].
        ``loss_tokens`` may be omitted only when the model prices them at 0."""
        L = np.asarray(tokens, dtype=np.float64)
        if loss_tokens is None:
            if self.coefficients["n_loss"] > 0:
                raise ValueError("this cost model prices loss tokens (n_loss > 0): pass each "
                                 "sample's loss-token count")
            loss_tokens = np.zeros_like(L)
        p2 = np.array([sum(p * p for p in ps) for ps in patches], dtype=np.float64)
        p1 = np.array([sum(ps) for ps in patches], dtype=np.float64)
        n_img = np.array([len(ps) for ps in patches], dtype=np.float64)
        feats = np.stack([L * L, L, np.ones_like(L), p2, p1, n_img,
                          np.asarray(loss_tokens, dtype=np.float64)], axis=-1)
        return feats @ self.vector

    def without_vision(self) -> "CostModel":
        """The same model with the encoder's terms at 0: what a step costs when no encoder runs
        (training on stored embeddings, ``data.vision_embeddings``)."""
        return dataclasses.replace(self, coefficients={**self.coefficients, **dict.fromkeys(VISION_TERMS, 0.0)})

    def term_shares(self, features: np.ndarray) -> dict[str, float]:
        """Each term's share of the total predicted time over ``features`` [n, 6]."""
        parts = (np.asarray(features, dtype=np.float64) * self.vector).sum(axis=0)
        total = parts.sum()
        return {t: float(v / total) if total > 0 else 0.0 for t, v in zip(TERMS, parts)}

    def crossover_length(self) -> Optional[float]:
        """The sample length where the attention term a*L^2 equals the linear term b*L."""
        a, b = self.coefficients["sum_L2"], self.coefficients["sum_L"]
        return b / a if a > 0 else None

    # -- persistence ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": COST_FORMAT,
                "model": "t = a*sum_L2 + b*sum_L + c*N + d*sum_P2 + e*sum_P + f*n_img + g*n_loss "
                         "(+ micro_batch_overhead_s per micro-batch)",
                "terms": {t: TERM_DESCRIPTIONS[t] for t in TERMS},
                **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict, *, origin: str = "cost model") -> "CostModel":
        if data.get("format") != COST_FORMAT:
            raise ValueError(f"{origin}: format {data.get('format')!r} is not {COST_FORMAT!r}; "
                             "write it with `loongforge fit-cost`")
        coefficients = {t: 0.0 for t in _OPTIONAL_TERMS} | {k: float(v) for k, v in data["coefficients"].items()}
        return cls(coefficients=coefficients,
                   units=data.get("units", "seconds"), source=data.get("source", "file"),
                   environment=data.get("environment", {}), accuracy=data.get("accuracy", {}),
                   micro_batch_overhead_s=float(data.get("micro_batch_overhead_s", 0.0)))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read cost model ({exc}); pass a COST.json written "
                             "by `loongforge fit-cost`") from exc
        return cls.from_dict(data, origin=str(path))


def with_vision_spread(model: CostModel, ranks: int) -> CostModel:
    """``model`` with its vision terms divided by ``ranks``: the per-rank price of a sample when
    ``ranks`` ranks share the encoder work of a data-parallel replica's samples
    (``parallel.encoder_dp``: the TP group with ``tp``, the TP x PP group with ``full``). The
    language terms are unchanged: each rank runs its own share of the language model either way."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if ranks == 1:
        return model
    coefficients = {t: v / ranks if t in VISION_TERMS else v for t, v in model.coefficients.items()}
    return replace(model, coefficients=coefficients)


def context_parallel_row_seconds(model: CostModel, row: Sequence[SampleCost], context_parallel: int, *,
                                 encoder_cp: bool) -> float:
    """Predicted seconds one CP rank spends on a packed row split over ``context_parallel`` ranks.

    Language: ``CONTEXT_SPLIT_TERMS`` / CP, N whole. Vision: with ``encoder_cp`` the CP ranks divide
    the row's images and video frames as ``parallel.media_assign`` deals them (longest first onto
    the least-loaded rank; a video's frames where ``grids`` are known, else whole), and the step
    waits for the slowest rank's share: about 1/CP of the row's, more when one image dominates;
    without it every rank encodes all of them.
    """
    if context_parallel < 1:
        raise ValueError(f"context_parallel must be at least 1, got {context_parallel}")
    features = batch_features(row)  # [7]
    divisors = np.array([context_parallel if term in CONTEXT_SPLIT_TERMS else 1 for term in TERMS], dtype=np.float64)
    language = np.array([term in LANGUAGE_TERMS for term in TERMS], dtype=np.float64)
    media = [patches for sample in row for patches in sample.patches]
    frames = [t for sample in row for t in _frames_per_medium(sample)]
    encoder = _slowest_encoder_seconds(model, media, frames, context_parallel if encoder_cp else 1)
    return float(features * language / divisors @ model.vector) + encoder + model.micro_batch_overhead_s


def _frames_per_medium(sample: SampleCost) -> list[int]:
    """t of each medium where its grid is known, else 1 (dealt whole)."""
    return [grid[0] for grid in sample.grids] if sample.grids else [1] * len(sample.patches)


def _slowest_encoder_seconds(model: CostModel, media: list[int], frames: list[int], ranks: int) -> float:
    """The vision terms of the most loaded of ``ranks`` ranks dividing the frames of ``media``
    (patches and frames of each)."""
    coefficients = [model.coefficients[term] for term in VISION_TERMS]
    if not media or not any(coefficients):  # VisionCost needs a nonzero term
        return 0.0
    costs = frame_costs(media, frames, VisionCost(*coefficients))
    loads = [0.0] * ranks
    for piece, owner in zip(costs, deal(costs, ranks)):
        loads[owner] += piece
    return max(loads)


@dataclass(frozen=True)
class EncoderCpGain:
    """One CP rank's predicted seconds on a row with ``parallel.encoder_cp`` on and off."""

    context_parallel: int
    on_s: float
    off_s: float

    @property
    def gain(self) -> float:
        """Share of the off time that sharing the encoder saves."""
        return 1.0 - self.on_s / self.off_s if self.off_s > 0 else 0.0


def encoder_cp_gain(model: CostModel, row: Sequence[SampleCost], context_parallel: int) -> EncoderCpGain:
    """What ``parallel.encoder_cp`` buys on ``row`` at CP ``context_parallel`` (``context_parallel_row_seconds``)."""
    on, off = (context_parallel_row_seconds(model, row, context_parallel, encoder_cp=shared) for shared in (True, False))
    return EncoderCpGain(context_parallel, on, off)


def token_count_model() -> CostModel:
    """Plain token counts (what balancers use before any fit): t = sum L."""
    return CostModel({t: (1.0 if t == "sum_L" else 0.0) for t in TERMS}, units="tokens",
                     source="tokens")


def flops_model(*, hidden: int, layers: int, params_language: float, vision_hidden: int,
                vision_full_attention_layers: int, params_vision: float,
                achieved_flops_per_s: float) -> CostModel:
    """Coefficients from FLOP counts (forward+backward = 3x forward) at a given achieved throughput.

    LLM: 6 * params FLOPs per token; causal attention 2 * 2 * L^2 * hidden / 2 per layer forward.
    ``layers``: the layers with an L^2 term, a hybrid decoder's full-attention ones only (its
    linear-attention layers are linear in L: their work belongs in ``params_language``'s term).
    ViT: 6 * params per patch; full attention 2 * 2 * P^2 * width per full-attention block forward
    (windowed blocks are linear in P and folded into the per-patch term).
    """
    s = 1.0 / achieved_flops_per_s
    return CostModel({
        "sum_L2": 3 * 2 * hidden * layers * s,
        "sum_L": 6 * params_language * s,
        "N": 0.0,
        "sum_P2": 3 * 4 * vision_hidden * vision_full_attention_layers * s,
        "sum_P": 6 * params_vision * s,
        "n_img": 0.0,
        "n_loss": 0.0,  # the head is counted in params_language, on every token
    }, source="flops")


# The documented default: Qwen2.5-VL-7B in bf16 on an H100-class GPU at 400 TFLOP/s achieved
# (about 40% of dense bf16 peak), from FLOP counts; replace it with a fitted COST.json.
QWEN2_5_VL_7B_H100 = dict(hidden=3584, layers=28, params_language=7.07e9, vision_hidden=1280,
                          vision_full_attention_layers=4, params_vision=0.68e9,
                          achieved_flops_per_s=4.0e14)


def default_cost_model() -> CostModel:
    model = flops_model(**QWEN2_5_VL_7B_H100)
    model.environment = {"preset": "qwen2.5vl-7b", "device": "H100-class (modelled)", "dtype": "bf16",
                         "achieved_flops_per_s": QWEN2_5_VL_7B_H100["achieved_flops_per_s"]}
    model.source = "default"
    return model
