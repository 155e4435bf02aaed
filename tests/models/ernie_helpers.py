"""A tiny random transformers ERNIE-4.5-VL (every parameter random, the routers' biases too) and its loongforge
config, read from its config.json as ``convert`` reads it."""

from __future__ import annotations

import torch

from loongforge.config.schema import ModelConfig
from loongforge.models.ernie4_5_vl import FAMILY

# Vocabulary 300 (not a multiple of 128: the padded rows are exercised); the image ids inside it.
IMAGE_START, IMAGE, IMAGE_END, VIDEO = 290, 291, 292, 293


def tiny_hf_config_dict(**text_overrides) -> dict:
    text = dict(model_type="ernie4_5_vl_moe_text", vocab_size=300, hidden_size=64, intermediate_size=96,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                moe_intermediate_size=[32, 16], moe_k=2, moe_num_experts=4, moe_num_shared_experts=2,
                mlp_layer_types=["dense", "sparse", "sparse"], use_bias=False, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]})
    text.update(text_overrides)
    vision = dict(model_type="ernie4_5_vl_moe_vision", depth=2, hidden_size=64, num_heads=4, intermediate_size=128,
                  patch_size=14, spatial_merge_size=2, temporal_merge_size=2, rms_norm_eps=1e-6, hidden_act="quick_gelu",
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return dict(architectures=["Ernie4_5_VLMoeForConditionalGeneration"], model_type="ernie4_5_vl_moe",
                text_config=text, vision_config=vision, image_start_token_id=IMAGE_START, image_token_id=IMAGE,
                image_end_token_id=IMAGE_END, video_token_id=VIDEO, video_start_token_id=294, video_end_token_id=295,
                tie_word_embeddings=text["tie_word_embeddings"])


def tiny_cfg(**text_overrides) -> ModelConfig:
    return FAMILY.config_from_hf(tiny_hf_config_dict(**text_overrides), "ernie/config.json")


def build_hf(model_cfg: ModelConfig, seed: int = 0, **text_overrides):
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    config_dict = tiny_hf_config_dict(**text_overrides)
    config = Ernie4_5_VLMoeConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Ernie4_5_VLMoeForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "e_score_correction_bias" in name:
                param.copy_(0.2 * noise)
            elif "norm" in name or name.endswith(("ln.weight", "after_norm.weight")):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.05 * noise)
    return model


def sample(images: tuple[tuple[int, int, int], ...], seed: int = 0, text_len: int = 7):
    """(ids [1, L]: text, each image as start + its tokens + end, text; pixel rows; grids; the processor's
    mm_token_type_ids and moe_mm_token_type_ids)."""
    generator = torch.Generator().manual_seed(seed)
    ids, rows = [torch.randint(0, 280, (text_len,), generator=generator)], []
    for t, h, w in images:
        ids += [torch.tensor([IMAGE_START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([IMAGE_END]),
                torch.randint(0, 280, (3,), generator=generator)]
        rows.append(torch.randn(t * h * w, 3 * 14 * 14, generator=generator))
    ids = torch.cat(ids)[None]
    grids = torch.tensor(images, dtype=torch.long) if images else None
    kinds = (ids == IMAGE).long()
    experts = torch.isin(ids, torch.tensor([IMAGE_START, IMAGE, IMAGE_END])).long()
    return ids, (torch.cat(rows) if rows else None), grids, kinds, experts
