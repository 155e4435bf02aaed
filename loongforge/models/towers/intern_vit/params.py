"""Parameter counts of InternVL's vision part by arithmetic on the config (no tensors): from the run's
``ModelConfig`` (``encoder_parameters``, the part's count) or from an HF ``InternViTConfig``
(``tower_parameters`` / ``projector_parameters``, every published variant: RMSNorm, q/k norm, qkv
without bias)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.layer_costs import linear_parameters as _linear
from loongforge.models.towers.intern_vit.config import InternViTConfig


def encoder_parameters(model_cfg: ModelConfig) -> tuple[int, int]:
    """(InternViT's, the pixel-shuffle projector's) parameter counts: ``parts.TowerPart.parameters``."""
    config = InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector)
    return tower_parameters(config), projector_parameters(config, model_cfg.projector.out_hidden_size)


def _norm(width: int, norm_type: str) -> int:
    """A LayerNorm has a weight and a bias, an RMSNorm a weight."""
    return 2 * width if norm_type == "layer_norm" else width


def tower_parameters(config: InternViTConfig) -> int:
    """transformers' ``InternVLVisionModel`` with ``config`` (no mask token, no final norm)."""
    h, ffn, side = config.hidden_size, config.intermediate_size, config.patches_per_side
    embeddings = _linear(config.num_channels * config.patch_size**2, h, bias=True) + h + (1 + side * side) * h
    attention = 3 * _linear(h, h, bias=config.attention_bias) + _linear(h, h, bias=True)
    # q/k norms are RMSNorms over all heads (width h), whatever norm_type says.
    qk_norms = 2 * h if config.use_qk_norm else 0
    block = (2 * _norm(h, config.norm_type) + attention + qk_norms + _linear(h, ffn, True) + _linear(ffn, h, True)
             + 2 * h)  # + lambda_1, lambda_2
    return embeddings + config.num_hidden_layers * block


def projector_parameters(config: InternViTConfig, text_hidden_size: int) -> int:
    """transformers' ``InternVLMultiModalProjector``: LayerNorm(m^2 h), m^2 h -> text -> text."""
    merged = config.hidden_size * config.merge_factor**2
    return 2 * merged + _linear(merged, text_hidden_size, True) + _linear(text_hidden_size, text_hidden_size, True)
