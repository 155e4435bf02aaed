"""Model FLOPs of one training step on a packed micro-batch: the numerator of MFU.

Each family counts its own towers in its folder (``<family>/flops.py``, the family contract's
``training_flops``) with the pieces here: the convention, the pass counts the training options imply,
the decoder layers over packed segments (each layer's token mixer and MLP by its kind,
``models.decoder.layer_costs``), the LM head, and what vision towers share. Pure arithmetic,
no torch: the dry-run plan and the benchmarks read it without building a model.

Convention:

- a multiply-add is 2 FLOPs: a linear ``fan_in -> fan_out`` over ``n`` tokens is ``2 n fan_in fan_out``;
- attention is QK^T and AV over the full ``L x L`` square of every segment it runs on (a packed
  sample, a vision window, a frame): ``4 L^2 q_width`` with ``q_width = heads * head_dim``, for causal
  attention too. That is what the kernels execute and what ``torch.utils.flop_counter.FlopCounterMode``
  counts, and PaLM's MFU convention (Chowdhery et al. 2022, appendix B);
- forward x1, backward x2 (activation gradients and weight gradients), except where no gradient is
  needed: the patch embedding takes none w.r.t. its pixels (x1, its weight gradient), nothing runs
  backward below a frozen tower, and a frozen part above a trained one computes activation gradients
  only (x1); see ``FlopOptions``;
- a hybrid decoder's linear-attention layers (Gated DeltaNet, ``model.language.layer_types``) are
  linear in the sample length: their projections, the causal convolution (``2 K`` per channel and
  token, ``K`` taps) and the chunked gated delta rule, ``layer_costs.gated_delta_rule_flops``: per token and
  value head ``6 d_k d_v + 2 C (3 d_k + 2 d_v)`` with fla's chunk ``C = 64``, what its kernel
  multiplies (see there). Full-attention layers keep the ``L^2`` term; with an output gate their
  q projection is twice as wide (each head's query and gate);
- full activation recompute runs every transformer layer's forward (vision blocks and decoder layers)
  a second time in the backward; patch embedding, mergers and LM head are not recomputed;
- the LM head runs on the loss tokens only (``models.decoder.language_model``), over the true
  vocabulary (megatron's padding rows are work, not the model's).

Not counted: norms, rotary embeddings, softmax, activations, biases, the embedding lookup, Qwen3-VL's
position-embedding resampling (a gather and a weighted sum), DeepStack's additions, the loss, and
the score recompute inside flash-style attention backward kernels (hardware work, like activation
recompute, but not asked for by any option). Of the linear-attention and gated layers likewise: the
output gates' products, the decays and masks inside a chunk, the triangular solve of each chunk
(about ``C^2 / 3`` per token and head, under 1% of the rule at Qwen3.5's sizes) and the chunk states
fla's backward recomputes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

from loongforge.balance.cost_model import SampleCost
from loongforge.config.schema import LanguageConfig, ModelConfig, TrainingConfig, VisionConfig
from loongforge.models.decoder.layer_costs import (
    FULL_ATTENTION,
    attention_flops,
    linear_flops,
    mlp,
    token_mixer,
    indexer_flops,
)

Grid = tuple[int, int, int]  # (t, h, w) patches of one image or video

# Passes of a trained layer, in forward-equivalents: the forward, then the backward's activation
# gradients and weight gradients (each a matmul of the forward's size).
FORWARD, ACTIVATION_GRADIENTS, WEIGHT_GRADIENTS = 1, 1, 1
TRAINED = FORWARD + ACTIVATION_GRADIENTS + WEIGHT_GRADIENTS


@dataclass(frozen=True)
class StepFlops:
    """Training FLOPs of one micro-batch (forward + backward, recompute where asked) by part;
    ``total`` is what MFU divides."""

    vision: float  # patch embedding and transformer blocks
    projector: float  # the merger (and Qwen3-VL's DeepStack mergers)
    language: float  # decoder layers
    lm_head: float

    @property
    def total(self) -> float:
        return self.vision + self.projector + self.language + self.lm_head

    @property
    def encoder_share(self) -> float:
        """(vision + projector) / total; 0 for an empty step."""
        return (self.vision + self.projector) / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "encoder_share": self.encoder_share}

    def __add__(self, other: "StepFlops") -> "StepFlops":
        return StepFlops(vision=self.vision + other.vision, projector=self.projector + other.projector,
                         language=self.language + other.language, lm_head=self.lm_head + other.lm_head)


NO_FLOPS = StepFlops(vision=0.0, projector=0.0, language=0.0, lm_head=0.0)


@dataclass(frozen=True)
class FlopOptions:
    """The training settings that change which passes run."""

    # Full activation recompute (training.recompute_activations): every layer's forward runs twice.
    recompute: bool = False
    # Frozen parts run forward only (training.freeze_vision / freeze_projector); a frozen projector
    # under a trained tower still passes activation gradients down to it.
    freeze_vision: bool = False
    freeze_projector: bool = False
    # A frozen language model (training.freeze_language) under a trained encoder part still carries
    # activation gradients down to it, through every layer and the LM head.
    freeze_language: bool = False

    @classmethod
    def from_training(cls, training: TrainingConfig) -> "FlopOptions":
        return cls(recompute=training.recompute_activations, freeze_vision=training.freeze_vision,
                   freeze_projector=training.freeze_projector, freeze_language=training.freeze_language)


# ---------------------------------------------------------------------------------------------
# Passes per part, in forward-equivalents
# ---------------------------------------------------------------------------------------------


def layer_passes(*, trained: bool, recompute: bool) -> int:
    """A transformer layer: forward, a second forward under recompute, and both gradients. A frozen
    layer with nothing trained below it runs forward once (with no gradient its checkpoint keeps
    nothing to recompute)."""
    if not trained:
        return FORWARD
    return TRAINED + (FORWARD if recompute else 0)


def vision_block_passes(options: FlopOptions) -> int:
    return layer_passes(trained=not options.freeze_vision, recompute=options.recompute)


def patch_embedding_passes(options: FlopOptions) -> int:
    """Forward, and its weight gradient when trained: pixels take no gradient."""
    return FORWARD if options.freeze_vision else FORWARD + WEIGHT_GRADIENTS


def patch_embedding_flops(grids: Sequence[Grid], *, in_channels: int, temporal_patch_size: int, patch_size: int,
                          width: int, options: FlopOptions) -> int:
    """The patch embedding over every patch (a linear from a patch's pixels to the tower's width)."""
    patches = sum(t * h * w for t, h, w in grids)
    pixel_width = in_channels * temporal_patch_size * patch_size ** 2
    return patch_embedding_passes(options) * linear_flops(patches, pixel_width, width)


def projector_passes(options: FlopOptions) -> int:
    """A merger. Trained: both gradients, also under a frozen tower, because every merger here
    normalises its input with learned weights before its first linear, whose input gradient those
    weights need. Frozen under a trained tower: activation gradients only, carrying the loss down.
    Both frozen: forward only."""
    if not options.freeze_projector:
        return TRAINED
    if not options.freeze_vision:
        return FORWARD + ACTIVATION_GRADIENTS
    return FORWARD


def language_layer_passes(options: FlopOptions) -> int:
    if not options.freeze_language:
        return layer_passes(trained=True, recompute=options.recompute)
    # Frozen above a trained encoder part (validation refuses a run that trains nothing): no weight
    # gradients, but the activation gradients pass through, and recompute runs the forward again.
    return FORWARD + ACTIVATION_GRADIENTS + (FORWARD if options.recompute else 0)


def lm_head_passes(options: FlopOptions) -> int:
    """The LM head is never recomputed; its weight (the embedding when tied) trains with the
    language model."""
    return FORWARD + ACTIVATION_GRADIENTS if options.freeze_language else TRAINED


# ---------------------------------------------------------------------------------------------
# The decoder's layers
# ---------------------------------------------------------------------------------------------


def decoder_layer_types(lang: LanguageConfig) -> list[str]:
    """Each decoder layer's token mixer, in order: ``model.language.layer_types``, every layer full
    attention when it is empty. Its first ``num_layers`` entries: a caller that counts the model without
    its layers (``num_layers=0``, as the dry run and ``fit-cost`` do) leaves the list as it is."""
    if not lang.layer_types:
        return [FULL_ATTENTION] * lang.num_layers
    if len(lang.layer_types) < lang.num_layers:
        raise ValueError(f"model.language.layer_types has {len(lang.layer_types)} entries but num_layers="
                         f"{lang.num_layers}; give one per layer")
    return list(lang.layer_types[:lang.num_layers])


def layers_keyed_apart(lang: LanguageConfig) -> bool:
    """Whether megatron-core saves each decoder layer under checkpoint keys of its own (its non-homogeneous
    layers) rather than stacked: where the layers differ in tensors, a hybrid decoder's (``layer_types``:
    ``linear_attention_freq``) or DeepSeek's dense first layers before sparse ones (``moe_layer_freq``)."""
    return bool(lang.layer_types) or bool(lang.moe and lang.moe.first_dense_layers)


def sparse_layers(lang: LanguageConfig) -> list[bool]:
    """Whether each decoder layer holds experts: every layer of a model with experts but its first
    ``moe.first_dense_layers`` (DeepSeek's), none of a dense model."""
    if not lang.moe:
        return [False] * lang.num_layers
    return [index >= lang.moe.first_dense_layers for index in range(lang.num_layers)]


def with_layers(lang: LanguageConfig, num_layers: int, *, first_dense: int = 0, **changes) -> LanguageConfig:
    """``lang`` cut to ``num_layers`` decoder layers, the first ``first_dense`` of them dense where it has
    experts (``changes``: other fields to replace), for counting a part of the decoder alone."""
    moe = replace(lang.moe, first_dense_layers=first_dense) if lang.moe else None
    return replace(lang, num_layers=num_layers, moe=moe, **changes)


def attention_width(lang: LanguageConfig) -> float:
    """The width w of a full-attention layer's ``4 L^2 w`` attention FLOPs (QK^T and AV over a segment of L),
    its mixer's (``layer_costs``: GQA's query width, multi-latent attention's mean of query and value widths)."""
    return token_mixer(lang, FULL_ATTENTION).attention_width(lang)


def decoder_layer_forward_flops(lang: LanguageConfig, segment_lengths: Sequence[int],
                                layer_type: str = FULL_ATTENTION, sparse: bool = True, vision_tokens: int = 0) -> int:
    """One decoder layer over packed segments: its token mixer (``layer_type``: full or multi-latent
    attention with its ``L^2`` term, or linear attention) and the MLP (``sparse``: experts, where the model
    has them; ``vision_tokens`` of the tokens go to modality-isolated experts' vision set)."""
    return (token_mixer(lang, layer_type).forward_flops(lang, segment_lengths)
            + mlp(lang, sparse).forward_flops(lang, sum(segment_lengths), vision_tokens))


def decoder_layers_forward_flops(lang: LanguageConfig, segment_lengths: Sequence[int],
                                 vision_tokens: int = 0) -> list[int]:
    """Each decoder layer's forward FLOPs, in order (layers of one type and MLP counted once)."""
    kinds = list(zip(decoder_layer_types(lang), sparse_layers(lang)))
    per_kind = {kind: decoder_layer_forward_flops(lang, segment_lengths, *kind, vision_tokens=vision_tokens)
                for kind in set(kinds)}
    return [per_kind[kind] for kind in kinds]


def mtp_layer_forward_flops(lang: LanguageConfig, segment_lengths: Sequence[int]) -> int:
    """One multi-token-prediction layer: the projection of [embedding, hidden] ``2h -> h`` and a decoder layer
    (sparse where the model has experts); its head is ``lm_head_flops``'."""
    tokens, h = sum(segment_lengths), lang.hidden_size
    return linear_flops(tokens, 2 * h, h) + decoder_layer_forward_flops(lang, segment_lengths, FULL_ATTENTION)


def language_flops(lang: LanguageConfig, segment_lengths: Sequence[int], options: FlopOptions,
                   vision_tokens: int = 0) -> int:
    """Every decoder layer, each by its type and MLP, and the multi-token-prediction layers, forward and
    backward; ``vision_tokens``: the tokens modality-isolated experts route to their vision set."""
    mtp = lang.mtp_num_layers * mtp_layer_forward_flops(lang, segment_lengths) if lang.mtp_num_layers else 0
    layers = sum(decoder_layers_forward_flops(lang, segment_lengths, vision_tokens))
    # Sparse attention's indexer and its loss: the forward once, and again where recompute reruns the layer; the
    # backward (its own loss's) once.
    indexer_forward, indexer_backward = indexer_flops(lang, segment_lengths)
    indexer = (lang.num_layers + lang.mtp_num_layers) * (
        (FORWARD + (FORWARD if options.recompute else 0)) * indexer_forward + indexer_backward)
    return language_layer_passes(options) * (layers + mtp) + indexer


def lm_head_flops(lang: LanguageConfig, loss_tokens: int, options: FlopOptions = FlopOptions()) -> int:
    """The output layer ``h -> vocab`` on the loss tokens, forward and backward; once more for each
    multi-token-prediction layer (the head they share)."""
    heads = 1 + lang.mtp_num_layers
    return heads * lm_head_passes(options) * linear_flops(loss_tokens, lang.hidden_size, lang.vocab_size)


def vision_block_saved_values(width: int, intermediate: int, tp: int, *, gated: bool) -> float:
    """The values one pre-norm vision block saves for its backward, per patch: 4 w whole (the two norms' inputs
    and the linears they feed), and split over the vision TP q, k, v and the attention output (4 w) and the
    MLP's (gated: gate, up and their product, 3 i; plain: the up projection and its activation, 2 i). Not the
    attention scores (flash-style kernels recompute them). A tower's ``TowerPart.saved_values``."""
    return 4 * width + (4 * width + (3 if gated else 2) * intermediate) / tp


def plain_block_saved_values(model_cfg: ModelConfig, tp: int) -> float:
    """``vision_block_saved_values`` of a tower whose blocks have a plain (ungated) MLP at ``model.vision``'s
    widths, whatever its activation (SigLIP's tanh-GELU, RICE-ViT's GELU, ERNIE's quick-GELU)."""
    vis = model_cfg.vision
    return vision_block_saved_values(vis.hidden_size, vis.intermediate_size, tp, gated=False)


def vision_block_linear_flops(patches: int, width: int, intermediate: int, *, gated: bool) -> int:
    """One vision block's matmuls but attention: QKV (``w -> 3w``), output projection, and the MLP
    (gated: gate and up ``w -> intermediate``, down; plain: up and down)."""
    mlp_matrices = 3 if gated else 2
    return linear_flops(patches, width, 3 * width) + linear_flops(patches, width, width) + linear_flops(
        patches, width, mlp_matrices * intermediate)


def merger_forward_flops(merged_tokens: int, merged_width: int, out_width: int) -> int:
    """A patch merger's MLP: ``m^2 w -> m^2 w -> out`` per merged token."""
    return linear_flops(merged_tokens, merged_width, merged_width) + linear_flops(merged_tokens, merged_width,
                                                                                  out_width)


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Patches of every frame (temporal patch) of every medium: the full-attention segments."""
    return [h * w for t, h, w in grids for _ in range(t)]


def frame_attention_flops(grids: Sequence[Grid], q_width: int) -> int:
    """One vision block's attention within each frame of every medium (no windows)."""
    return attention_flops(frame_lengths(grids), q_width)


def patch_tower_flops(grids: Sequence[Grid], options: FlopOptions, *, in_channels: int, temporal_patch_size: int,
                      patch_size: int, width: int, blocks_forward: int) -> int:
    """A patch tower: its patch embedding, and its blocks' forward (``blocks_forward``, all blocks
    summed) times the passes that train them."""
    embedding = patch_embedding_flops(grids, in_channels=in_channels, temporal_patch_size=temporal_patch_size,
                                      patch_size=patch_size, width=width, options=options)
    return embedding + vision_block_passes(options) * blocks_forward


def plain_frame_tower_flops(vis: VisionConfig, grids: Sequence[Grid], options: FlopOptions) -> int:
    """A patch tower of ``vis.depth`` blocks with a plain (ungated) MLP, each frame one attention segment,
    one frame a temporal patch (SigLIP, ERNIE's ViT): ``patch_tower_flops`` of its blocks."""
    patches = sum(t * h * w for t, h, w in grids)
    blocks = vis.depth * (vision_block_linear_flops(patches, vis.hidden_size, vis.intermediate_size, gated=False)
                          + frame_attention_flops(grids, vis.hidden_size))
    return patch_tower_flops(grids, options, in_channels=vis.in_channels, temporal_patch_size=1,
                             patch_size=vis.patch_size, width=vis.hidden_size, blocks_forward=blocks)


def patch_merger_flops(grids: Sequence[Grid], options: FlopOptions, *, merge: int, width: int,
                       out_width: int) -> int:
    """A patch merger over every merged token (``merge x merge`` patches of ``width``), times the
    passes that train it."""
    merged_tokens = sum(t * h * w for t, h, w in grids) // (merge * merge)
    return projector_passes(options) * merger_forward_flops(merged_tokens, width * merge * merge, out_width)


# ---------------------------------------------------------------------------------------------
# Samples -> what the count needs
# ---------------------------------------------------------------------------------------------


def media_grids(samples: Sequence[SampleCost]) -> list[Grid]:
    """Every image's and video's (t, h, w) grid; ValueError when a sample has patches but no grids
    (a cost model's size estimate): the vision count depends on the shape, not only on P."""
    grids: list[Grid] = []
    for index, sample in enumerate(samples):
        if sample.patches and not sample.grids:
            raise ValueError(
                f"sample {index} has {len(sample.patches)} image(s)/video(s) ({sum(sample.patches)} patches) "
                "but no grids: the vision FLOPs need each medium's (t, h, w) patch grid; build the "
                "SampleCosts from a micro-batch with loongforge.profile.features.sample_costs, or pass "
                "SampleCost(grids=...)")
        grids.extend(tuple(grid) for grid in sample.grids)
    return grids


def refuse_media(samples: Sequence[SampleCost], family: str) -> None:
    """A text-only family: any image or video is a mistake of the caller."""
    with_media = [index for index, sample in enumerate(samples) if sample.patches or sample.grids]
    if with_media:
        raise ValueError(f"samples {with_media} carry images or videos, but model.family={family} is text-only; "
                         "count them with a vision family's training_flops")


def step_flops(model_cfg: ModelConfig, samples: Sequence[SampleCost], options: FlopOptions, *,
               vision: float = 0.0, projector: float = 0.0) -> StepFlops:
    """A step's parts: the family's encoder counts, and the decoder layers over the samples as packed
    segments and the LM head on their loss tokens (which every family shares)."""
    lang = model_cfg.language
    segment_lengths = [sample.tokens for sample in samples]
    loss_tokens = sum(sample.loss_tokens for sample in samples)
    return StepFlops(vision=float(vision), projector=float(projector),
                     language=float(language_flops(lang, segment_lengths, options, vision_routed_tokens(model_cfg, samples))),
                     lm_head=float(lm_head_flops(lang, loss_tokens, options)))


def vision_routed_tokens(model_cfg: ModelConfig, samples: Sequence[SampleCost]) -> int:
    """The tokens a decoder with modality-isolated experts routes to its vision set: each image's placeholders
    (its merged patches) and the two markers around them; 0 for any other decoder."""
    moe = model_cfg.language.moe
    if moe is None or not moe.vision_ffn_hidden_size or model_cfg.projector is None:
        return 0
    unit = model_cfg.projector.spatial_merge_size**2
    return sum(t * h * w // unit + 2 for sample in samples for t, h, w in sample.grids)


# (model_cfg, the micro-batch's media grids, options) -> (vision, projector) FLOPs: a tower part's count.
EncoderFlops = Callable[[ModelConfig, Sequence[Grid], FlopOptions], tuple[int, int]]


def vlm_training_flops(encoder_flops: EncoderFlops, model_cfg: ModelConfig, samples: Sequence[SampleCost],
                       options: FlopOptions = FlopOptions()) -> StepFlops:
    """A VLM family's ``training_flops`` (bind ``encoder_flops``, its vision part's count): forward +
    backward FLOPs of one micro-batch of ``samples`` (packed segments of ``sample.tokens``, images
    and videos of ``sample.grids``)."""
    vision, projector = encoder_flops(model_cfg, media_grids(samples), options)
    return step_flops(model_cfg, samples, options, vision=vision, projector=projector)
