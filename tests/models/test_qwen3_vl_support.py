"""Shared pieces of the Qwen3-VL tests (dense and MoE): a tiny config, the matching random transformers model, sample
inputs (videos written as the processor writes them: a timestamp, then each frame in its own
vision_start/vision_end block) and transformers' own position ids and logits.

Named ``test_*`` to live beside the tests it serves; its tests check the vision facts' sources."""

from __future__ import annotations

import pytest
import torch

from loongforge.config.schema import LanguageConfig, ModelConfig, MoEConfig, ProjectorConfig, VisionConfig
from loongforge.models.towers.qwen3_vit.vision_facts import Qwen3VisionConfig

# The same sample form, transformers' positions and logits as Qwen2.5-VL's: re-exported for the Qwen3 tests.
from tests.models.helpers import Sample, hf_logits, hf_position_ids, our_inputs  # noqa: F401

# 3 vision blocks, 3 decoder layers; DeepStack from blocks 0 and 2 into decoder layers 0 and 1.
TINY_VISION = Qwen3VisionConfig(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=36,
    deepstack_visual_indexes=(0, 2), hidden_act="gelu_pytorch_tanh",
)
PATCH_DIM = 3 * 2 * 16 * 16  # channels * temporal patch * patch^2: one row of pixel_values
TIMESTAMP_TOKEN = 27  # stands for the "<1.5 seconds>" text before each video frame


# Qwen3-VL-MoE at toy size: every decoder layer 4 routed experts of width 48, top-2, renormalised
# (the only router transformers' Qwen3-VL-MoE has). 48, not 32: each expert's gate_up slice [96, 64]
# is not square, so reading it in the wrong orientation fails loudly instead of silently.
TINY_EXPERTS = MoEConfig(num_experts=4, ffn_hidden_size=48, router_topk=2, norm_topk_prob=True, aux_loss_coeff=0.001)


def tiny_model_cfg(*, tie: bool = False, experts: bool = False) -> ModelConfig:
    """The tiny dense Qwen3-VL; ``experts``: Qwen3-VL-MoE (``TINY_EXPERTS`` in every layer)."""
    vis = TINY_VISION
    return ModelConfig(
        family="qwen3_vl",
        vision=VisionConfig(depth=vis.depth, hidden_size=vis.hidden_size, intermediate_size=vis.intermediate_size,
                            num_heads=vis.num_heads, patch_size=vis.patch_size, hidden_act=vis.hidden_act,
                            norm="layer", num_position_embeddings=vis.num_position_embeddings,
                            deepstack_layers=list(vis.deepstack_visual_indexes)),
        projector=ProjectorConfig(spatial_merge_size=vis.spatial_merge_size, out_hidden_size=vis.out_hidden_size),
        language=LanguageConfig(
            num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            head_dim=32,  # != 64 / 4: Qwen3's free head width
            qk_norm=True, add_qkv_bias=False, vocab_size=151936, rope_theta=5e6, mrope_section=[6, 5, 5],
            mrope_interleaved=True,
            tie_word_embeddings=tie,
            moe=TINY_EXPERTS if experts else None,
        ),
        layer_backend="sdpa",
    )


def hf_config(model_cfg: ModelConfig, vision: Qwen3VisionConfig = TINY_VISION):
    """transformers' Qwen3VLConfig, or Qwen3VLMoeConfig for a model with experts."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    lang, tok = model_cfg.language, model_cfg.tokens
    moe = lang.moe
    experts = dict(num_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                   moe_intermediate_size=moe.ffn_hidden_size, router_aux_loss_coef=moe.aux_loss_coeff,
                   decoder_sparse_step=1, mlp_only_layers=[]) if moe else {}
    config_class = Qwen3VLMoeConfig if lang.moe else Qwen3VLConfig
    return config_class(
        text_config=dict(
            **experts,
            vocab_size=lang.vocab_size, hidden_size=lang.hidden_size, intermediate_size=lang.ffn_hidden_size,
            num_hidden_layers=lang.num_layers, num_attention_heads=lang.num_attention_heads,
            num_key_value_heads=lang.num_query_groups, head_dim=lang.head_dim, rms_norm_eps=lang.rms_norm_eps,
            max_position_embeddings=lang.max_position_embeddings, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": lang.rope_theta,
                             "mrope_section": list(lang.mrope_section), "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=vision.depth, hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
            num_heads=vision.num_heads, in_channels=vision.in_channels, patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size, spatial_merge_size=vision.spatial_merge_size,
            out_hidden_size=vision.out_hidden_size, num_position_embeddings=vision.num_position_embeddings,
            deepstack_visual_indexes=list(vision.deepstack_visual_indexes), hidden_act=vision.hidden_act,
        ),
        image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
        vision_start_token_id=tok.vision_start_token_id, vision_end_token_id=tok.vision_end_token_id,
        tie_word_embeddings=lang.tie_word_embeddings,
    )


def build_hf_model(model_cfg: ModelConfig, seed: int = 0):
    """A random fp32 transformers Qwen3-VL (Qwen3-VL-MoE with experts, eager attention); every
    parameter (norm weights and biases, position embeddings, mergers, routers, experts) drawn anew,
    so a wrong mapping of any tensor shows in the logits."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    config = hf_config(model_cfg)
    if model_cfg.language.moe:
        config._attn_implementation = "eager"
        model = Qwen3VLMoeForConditionalGeneration(config).float().eval()
    else:
        model = Qwen3VLForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_scale = "norm" in name and name.endswith("weight")
            torch.nn.init.normal_(param, mean=1.0 if is_norm_scale else 0.0, std=0.1 if is_norm_scale else 0.05,
                                  generator=generator)
    return model


def make_sample(
    model_cfg: ModelConfig,
    *,
    text_len: int = 12,
    images: tuple[tuple[int, int, int], ...] = (),
    videos: tuple[tuple[int, int, int], ...] = (),
    seed: int = 0,
) -> Sample:
    """Text; each image as <vs> pad*n <ve>; each video frame as <timestamp> <vs> pad*n <ve>; text."""
    g = torch.Generator().manual_seed(seed)
    tok, merge_unit = model_cfg.tokens, TINY_VISION.spatial_merge_size**2
    ids = [torch.randint(0, 150000, (text_len,), generator=g)]
    types = [torch.zeros(text_len, dtype=torch.long)]

    def block(n: int, token_id: int, type_id: int, prefix: tuple[int, ...] = ()):
        ids.extend([torch.tensor([*prefix, tok.vision_start_token_id]), torch.full((n,), token_id),
                    torch.tensor([tok.vision_end_token_id])])
        types.extend([torch.zeros(len(prefix) + 1, dtype=torch.long), torch.full((n,), type_id),
                      torch.zeros(1, dtype=torch.long)])

    pixels = {"image": [], "video": []}
    for t, h, w in images:
        block(t * h * w // merge_unit, tok.image_token_id, 1)
        pixels["image"].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
    for t, h, w in videos:
        for _ in range(t):
            block(h * w // merge_unit, tok.video_token_id, 2, prefix=(TIMESTAMP_TOKEN,))
        pixels["video"].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
    ids.append(torch.randint(0, 150000, (5,), generator=g))
    types.append(torch.zeros(5, dtype=torch.long))
    grid = lambda gs: torch.tensor(gs, dtype=torch.long) if gs else None  # noqa: E731
    cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
    return Sample(
        input_ids=torch.cat(ids)[None], mm_token_type_ids=torch.cat(types)[None],
        pixel_values=cat(pixels["image"]), image_grid_thw=grid(images),
        pixel_values_videos=cat(pixels["video"]), video_grid_thw=grid(videos),
    )


def test_vision_facts_read_from_the_hf_config():
    config = hf_config(tiny_model_cfg())
    assert Qwen3VisionConfig.from_hf(config.vision_config.to_dict()) == TINY_VISION


def test_vision_facts_from_model_cfg_need_the_qwen3_vl_fields():
    model_cfg = tiny_model_cfg()
    assert Qwen3VisionConfig.from_model_cfg(model_cfg) == TINY_VISION
    model_cfg.vision.deepstack_layers = []  # the tower without DeepStack taps (Qwen3.5's)
    assert Qwen3VisionConfig.from_model_cfg(model_cfg).num_deepstack_layers == 0
    model_cfg.vision.num_position_embeddings = None
    with pytest.raises(ValueError, match=r"model.vision.num_position_embeddings must be set"):
        Qwen3VisionConfig.from_model_cfg(model_cfg)
    model_cfg = tiny_model_cfg()
    model_cfg.vision.norm = "rms"
    with pytest.raises(ValueError, match="model.vision.norm='rms'"):
        Qwen3VisionConfig.from_model_cfg(model_cfg)
