"""Helpers of the towers' parity tests (InternVL's, LLaVA-OneVision's): a transformers model with every
parameter drawn at random, HF weights loaded through given rows into our module at its layout, and the
worst difference relative to the reference's largest value."""

from __future__ import annotations

import torch

from loongforge.models.hf.weights import hf_to_megatron, vision_tp_group


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn at random (norm weights around 1), none at its initial value."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * torch.randn_like(param))
    return model


def load_rows(module: torch.nn.Module, hf_state: dict, model_cfg, rules) -> None:
    """``hf_state`` into ``module`` through ``rules``: a composed model at its TP and vision-TP
    layout, or an encoder alone (TP 1)."""
    language = getattr(module, "language_model", None)
    tp = None if language is None else language.pg_collection.tp
    vision = None if language is None else vision_tp_group(module)
    converted = hf_to_megatron(hf_state, model_cfg, list(module.state_dict()), rules=rules,
                               tp_rank=0 if tp is None else tp.rank(), tp_size=1 if tp is None else tp.size(),
                               vision_tp_rank=0 if vision is None else vision.rank(),
                               vision_tp_size=1 if vision is None else vision.size())
    result = module.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())
