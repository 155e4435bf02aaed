"""Model FLOPs of one Qwen2.5-VL training step on a packed micro-batch: the numerator of MFU.

Counted (a multiply-add is 2 FLOPs; training = forward + backward = 3 x forward):

- vision encoder, per patch: the patch embedding (a linear over ``C*T*p*p`` pixels) and, per block,
  QKV, output projection and the SwiGLU MLP; attention per block is non-causal within its segments:
  ``4 * n^2 * width`` for a segment of ``n`` patches (QK^T and AV), where the segments are the
  windows (``window_size`` pixels square, edge windows smaller) in window blocks and whole frames
  in the ``fullatt_block_indexes`` blocks;
- projector, per merged token: the merger MLP ``(m^2*w -> m^2*w -> out)``;
- language model, per token and layer: QKV (grouped-query widths), output projection, SwiGLU MLP;
  causal attention per packed segment of length ``L``: ``2 * L^2 * hidden`` (half of the
  ``L x L`` scores, QK^T and AV);
- LM head: ``2 * hidden * vocab`` per token where it runs (the loss tokens).

Not counted: norms, rotary embeddings, activations, softmax, biases, the embedding lookup and the
padded vocabulary rows (work, but not the model's). Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from loongforge.config.schema import ModelConfig

# Backward costs twice the forward (gradients of activations and of weights).
TRAINING_MULTIPLIER = 3


@dataclass(frozen=True)
class StepFlops:
    """Training FLOPs (forward + backward) by part; ``total`` is what MFU divides."""

    vision: float
    projector: float
    language: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.vision + self.projector + self.language + self.lm_head

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def window_sizes(h: int, w: int, merge: int, window_units: int) -> list[int]:
    """Patches per attention window of one ``h x w``-patch frame: merge units tiled from the
    top-left in ``window_units``-square windows, edge windows smaller (``vision.window_partition``)."""
    units_h, units_w = h // merge, w // merge

    def spans(n: int) -> list[int]:
        return [min(window_units, n - start) for start in range(0, n, window_units)]

    return [rows * cols * merge * merge for rows in spans(units_h) for cols in spans(units_w)]


def vision_forward_flops(model_cfg: ModelConfig, grids: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(vision encoder, projector) forward FLOPs for images/videos with ``grids`` [(t, h, w), ...]."""
    vis, proj = model_cfg.vision, model_cfg.projector
    width, merge = vis.hidden_size, proj.spatial_merge_size
    window_units = vis.window_size // vis.patch_size // merge
    patches = sum(t * h * w for t, h, w in grids)
    pixel_width = vis.in_channels * vis.temporal_patch_size * vis.patch_size ** 2
    per_block = 2 * (3 * width * width + width * width + 3 * width * vis.intermediate_size)
    full_blocks = sum(1 for i in vis.fullatt_block_indexes if 0 <= i < vis.depth)
    window_sq = sum(t * n * n for t, h, w in grids for n in window_sizes(h, w, merge, window_units))
    frame_sq = sum(t * (h * w) ** 2 for t, h, w in grids)
    attention = 4 * width * (full_blocks * frame_sq + (vis.depth - full_blocks) * window_sq)
    encoder = patches * (2 * pixel_width * width + vis.depth * per_block) + attention
    merged_width = width * merge * merge
    projector = (patches // (merge * merge)) * 2 * (merged_width * merged_width
                                                     + merged_width * proj.out_hidden_size)
    return float(encoder), float(projector)


def language_forward_flops(model_cfg: ModelConfig, segment_lengths: Sequence[int]) -> float:
    """Decoder layers' forward FLOPs over packed segments of ``segment_lengths`` tokens. A
    mixture-of-experts layer costs its router and the ``moe_router_topk`` experts each token runs."""
    lang = model_cfg.language
    h, heads = lang.hidden_size, lang.num_attention_heads
    kv_width = h // heads * lang.num_query_groups
    if lang.num_experts:
        mlp = h * lang.num_experts + 3 * h * lang.moe_ffn_hidden_size * lang.moe_router_topk
    else:
        mlp = 3 * h * lang.ffn_hidden_size
    per_token = 2 * (h * (h + 2 * kv_width) + h * h + mlp)
    tokens = sum(segment_lengths)
    attention = 2 * h * sum(length * length for length in segment_lengths)
    return float(lang.num_layers * (tokens * per_token + attention))


def training_flops(model_cfg: ModelConfig, *, segment_lengths: Sequence[int],
                   grids: Sequence[Sequence[int]], loss_tokens: int) -> StepFlops:
    """Forward + backward FLOPs of one micro-batch (see the module docstring for what counts)."""
    encoder, projector = vision_forward_flops(model_cfg, grids)
    lang = model_cfg.language
    head = 2.0 * lang.hidden_size * lang.vocab_size * loss_tokens
    return StepFlops(vision=TRAINING_MULTIPLIER * encoder, projector=TRAINING_MULTIPLIER * projector,
                     language=TRAINING_MULTIPLIER * language_forward_flops(model_cfg, segment_lengths),
                     lm_head=TRAINING_MULTIPLIER * head)
