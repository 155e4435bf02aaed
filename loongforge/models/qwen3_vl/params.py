"""Parameter counts of Qwen3-VL by arithmetic on the config (the true vocabulary; tied embeddings once)."""

from __future__ import annotations

from loongforge.config.schema import ModelConfig
from loongforge.models.decoder.params import expert_parameters, language_parameters
from loongforge.models.decoder.params import linear_parameters as _linear


def count_parameters(model_cfg: ModelConfig) -> dict[str, int]:
    """{"vision_model", "projector", "language_model", "total", "active"}; ``projector`` counts the
    merger and the DeepStack mergers; ``active`` is what one token runs through (the towers whole,
    the router's top-k experts of each MoE layer; every parameter of a dense model)."""
    vis, proj = model_cfg.vision, model_cfg.projector
    h, ffn = vis.hidden_size, vis.intermediate_size
    patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size**2
    block = 4 * h + _linear(h, 3 * h, bias=True) + _linear(h, h, bias=True) + _linear(h, ffn, True) + _linear(ffn, h, True)
    vision_model = _linear(patch_dim, h, bias=True) + vis.num_position_embeddings * h + vis.depth * block
    merged = h * proj.spatial_merge_size**2

    def merger(norm_width: int) -> int:
        return 2 * norm_width + _linear(merged, merged, bias=True) + _linear(merged, proj.out_hidden_size, bias=True)

    projector = merger(h) + len(vis.deepstack_layers) * merger(merged)
    language_model = language_parameters(model_cfg.language)
    towers = vision_model + projector
    return {"vision_model": vision_model, "projector": projector, "language_model": language_model,
            "total": towers + language_model,
            "active": towers + language_parameters(model_cfg.language, active=True),
            "routed_experts": model_cfg.language.num_layers * expert_parameters(model_cfg.language)}
