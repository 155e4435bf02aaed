"""ERNIE-4.5-VL's vision part (``models/towers/ernie_vit``): the ViT and the variable-resolution resampler
equal transformers' vision tower + resampler on two images of other proportions and on a video (its frames
paired by the resampler), loaded through the tower's weight rows."""

from __future__ import annotations

import torch

from loongforge.config.schema import LanguageConfig, ModelConfig, ProjectorConfig, VisionConfig
from loongforge.models.towers.ernie_vit.encoder import ErnieVisionEncoder
from loongforge.models.towers.ernie_vit.hf_mapping import hf_shapes, tower_rules
from loongforge.models.towers.ernie_vit.vision import temporal_pairs
from loongforge.models.vlm.encoder import build_encoder_alone

DEPTH, HIDDEN, HEADS, PATCH = 2, 64, 4, 14


def hf_model(seed: int = 0):
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    config = Ernie4_5_VLMoeConfig(
        vision_config=dict(depth=DEPTH, hidden_size=HIDDEN, num_heads=HEADS, intermediate_size=128, patch_size=PATCH,
                           spatial_merge_size=2, temporal_merge_size=2, rms_norm_eps=1e-6),
        text_config=dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=[32, 16],
                         moe_num_experts=4, moe_k=2, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 2, 2]}))
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Ernie4_5_VLMoeForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if ("norm" in name or name.endswith(".ln.weight")) else 0.05 * noise)
    return model


def our_cfg() -> ModelConfig:
    return ModelConfig(
        vision=VisionConfig(arch="ernie_vit", depth=DEPTH, hidden_size=HIDDEN, intermediate_size=128, num_heads=HEADS,
                            patch_size=PATCH, temporal_patch_size=1, window=None, rms_norm_eps=1e-6,
                            hidden_act="quick_gelu", norm="layer"),
        projector=ProjectorConfig(arch="resampler", spatial_merge_size=2, hidden_act="gelu", out_hidden_size=48),
        language=LanguageConfig(hidden_size=48, rms_norm_eps=1e-5))


def hub_names(hf_state: dict) -> dict:
    """transformers' module names of the vision part -> the names ``save_pretrained`` writes."""
    renames = (("model.vision_tower.", "model.vision_model."), ("_linear.fc1.", "_linear.0."),
               ("_linear.fc2.", "_linear.2."), ("_linear.ln.", "_linear.3."))
    out = {}
    for key, value in hf_state.items():
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def load_rules(encoder, hf_state: dict, model_cfg: ModelConfig) -> None:
    hf_state, state = hub_names(hf_state), {}
    for rule in tower_rules(model_cfg):
        for i in range(DEPTH) if "{i}" in rule.megatron else [None]:
            keys = [key if i is None else key.format(i=i) for key in rule.hf]
            state[rule.megatron if i is None else rule.megatron.format(i=i)] = rule.transform.shard(
                [hf_state[key] for key in keys], 0, 1)
    ours = {**{f"vision_model.{k}": v for k, v in encoder.vision_model.state_dict().items()},
            **{f"projector.{k}": v for k, v in encoder.projector.state_dict().items()}}
    assert set(state) == {k for k in ours if not k.endswith("_extra_state")}, set(state) ^ set(ours)
    for key, value in state.items():
        ours[key].copy_(value)


def test_the_rows_cover_transformers_vision_tensors():
    hf_state = {k: tuple(v.shape) for k, v in hub_names(hf_model().state_dict()).items()
                if k.startswith(("model.vision_model.", "model.resampler_model."))}
    assert hf_shapes(our_cfg()) == hf_state


def test_temporal_pairs_pair_an_image_with_itself_and_a_videos_frames_two_by_two():
    first, second = temporal_pairs(torch.tensor([[1, 2, 4], [2, 2, 2]]), 2)
    assert first.tolist() == [0, 1, 2] and second.tolist() == [0, 1, 3]


def test_the_vision_part_equals_transformers(megatron_world_of_one):
    hf, model_cfg = hf_model(), our_cfg()
    encoder = build_encoder_alone(ErnieVisionEncoder.build, model_cfg, params_dtype=torch.float32, device="cpu",
                                  init_seed=0)
    with torch.no_grad():
        load_rules(encoder, hf.state_dict(), model_cfg)
    generator = torch.Generator().manual_seed(2)
    images = torch.tensor([[1, 4, 6], [1, 6, 2]])
    video = torch.tensor([[4, 4, 2]])
    worst = 0.0
    for grids, features in ((images, hf.model.get_image_features), (video, hf.model.get_video_features)):
        rows = torch.randn(int(grids.prod(-1).sum()), 3 * PATCH * PATCH, generator=generator)
        with torch.no_grad():
            expected = torch.cat(features(rows, grids).pooler_output)
            ours = encoder(rows, grids)
        assert ours.shape == expected.shape
        worst = max(worst, ((ours - expected).abs().max() / expected.abs().max()).item())
    print(f"ERNIE-4.5-VL vision part vs transformers: {worst:.2e} of the largest feature")
    assert worst < 2e-6
