"""Decoder parameter counts by arithmetic on the config: no tensors are allocated.

Counts use the true vocabulary (as published), not megatron's TP padding; tied embeddings count once.
A decoder layer counts as its norms, its token mixer and its MLP, each by its kind (``layer_costs``): a hybrid
decoder (Qwen3.5, ``model.language.layer_types``) counts each layer by its mixer, gated full attention or
Gated DeltaNet's linear attention; the norms and the MLP (or experts) are the same in both.
"""

from __future__ import annotations

from collections import Counter

from loongforge.config.schema import LanguageConfig, ModelConfig
from loongforge.models.decoder.layer_costs import FULL_ATTENTION, mlp, token_mixer
from loongforge.models.flops import decoder_layer_types, sparse_layers


def expert_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One layer's routed experts, router not included (0 in a dense model); ``active``: the
    ``moe.router_topk`` experts one token runs through."""
    return mlp(lang).routed_parameters(lang, active=active) if lang.moe else 0


def language_layer_parameters(lang: LanguageConfig, *, active: bool = False,
                              layer_type: str = FULL_ATTENTION, sparse: bool = True) -> int:
    """One decoder layer: 2 RMSNorms, its token mixer (``layer_type``: GQA or multi-latent attention, or
    Gated DeltaNet) and its MLP (SwiGLU or, ``sparse``, the experts; ``active``: those one token runs
    through), each counted by its kind (``layer_costs``)."""
    return (2 * lang.hidden_size + token_mixer(lang, layer_type).parameters(lang)
            + mlp(lang, sparse).parameters(lang, active=active))


def decoder_layers_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """Every decoder layer, each counted by its type (``flops.decoder_layer_types``) and MLP (dense or sparse)."""
    counts = Counter(zip(decoder_layer_types(lang), sparse_layers(lang)))
    return sum(count * language_layer_parameters(lang, active=active, layer_type=kind, sparse=sparse)
               for (kind, sparse), count in counts.items())


def language_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """Embedding, every layer, the final norm, and the output layer unless tied. ``active``: the
    parameters one token runs through (a dense model's are all of them; the embedding counts)."""
    embedding = lang.vocab_size * lang.hidden_size
    output_layer = 0 if lang.tie_word_embeddings else embedding
    layers = decoder_layers_parameters(lang, active=active)
    return embedding + layers + lang.hidden_size + output_layer + lang.mtp_num_layers * mtp_layer_parameters(
        lang, active=active)


def mtp_layer_parameters(lang: LanguageConfig, *, active: bool = False) -> int:
    """One multi-token-prediction layer: the embedding's and the hidden state's RMSNorms, their projection
    [h, 2h], a decoder layer (sparse where the model has experts) and the head's RMSNorm; the embedding and
    the head are the model's own."""
    h = lang.hidden_size
    return 3 * h + 2 * h * h + language_layer_parameters(lang, active=active)


def model_parameters(model_cfg: ModelConfig, vision_model: int = 0, projector: int = 0) -> dict[str, int]:
    """A model's counts, the encoder's given (0 for a text-only model): {"vision_model", "projector",
    "language_model", "total", "active", "routed_experts"}; ``active`` is what one token runs through
    (the encoder whole, the router's top-k experts of each MoE layer; every parameter of a dense
    model); ``routed_experts``: the experts of every MoE layer (0 if dense)."""
    lang = model_cfg.language
    encoder = vision_model + projector
    language_model = language_parameters(lang)
    return {"vision_model": vision_model, "projector": projector, "language_model": language_model,
            "total": encoder + language_model, "active": encoder + language_parameters(lang, active=True),
            "routed_experts": (sum(sparse_layers(lang)) + lang.mtp_num_layers) * expert_parameters(lang)}
