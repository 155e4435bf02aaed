"""SigLIP and the MLP projector (``models/towers/siglip``, a plain backbone) alone, as ``loongforge encode``
builds it: its features equal transformers' (``LlavaOnevisionModel``: the vision
tower's last hidden state, then ``multi_modal_projector``) at fp32 on squares whose side leaves pixels past
the last whole patch, every parameter randomised and every one trains; the parameter counts equal
transformers' (its unused post-layernorm apart), the tiny model's and the published sizes', with
LLaVA-OneVision's newline counted by its vision part. The composition (anyres packing of a real photo, two photos in one sample, TP 2 with and without sequence
parallelism, vision TP 1) is the ``llava_onevision`` reference's (``test_parity.py``, ``test_tp_parity.py``).
"""

from __future__ import annotations

import pytest
import torch

from loongforge.config.schema import VisionConfig
from loongforge.models import parts
from loongforge.models.llava_onevision.vision import VISION as LLAVA_ONEVISION_VISION
from loongforge.models.towers.siglip.encoder import SiglipEncoder
from loongforge.models.towers.siglip.hf_mapping import tower_rules
from loongforge.models.vlm.encoder import build_encoder_alone
from loongforge.models.vlm.pixels import patch_rows
from tests.models.references import llava_onevision_hf_model, llava_onevision_model_cfg
from tests.models.tower_helpers import load_rows, relative

TOLERANCE = 1e-5
SQUARES = 3


def test_the_encoder_alone_equals_transformers_and_every_parameter_trains(megatron_world_of_one):
    model_cfg = llava_onevision_model_cfg()
    hf = llava_onevision_hf_model(model_cfg)
    vis = model_cfg.vision
    side = vis.image_size // vis.patch_size  # 4 whole patches; a valid convolution leaves the last pixels out
    pixels = torch.randn(SQUARES, 3, vis.image_size, vis.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        last = hf.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]
        expected = hf.model.multi_modal_projector(last).flatten(0, 1)  # [squares * patches, LM hidden]
    encoder = build_encoder_alone(SiglipEncoder.build, model_cfg, params_dtype=torch.float32, device="cpu")
    # The rows under the Hub's names: the family's to_hub_style renames the state dict on reading.
    load_rows(encoder, hf.state_dict(), model_cfg,
              tower_rules(model_cfg, hf_prefix="vision_tower.", projector_prefix="multi_modal_projector."))
    whole = pixels[..., :side * vis.patch_size, :side * vis.patch_size].contiguous().numpy()
    rows, grids = torch.from_numpy(patch_rows(whole, vis.patch_size)), torch.tensor([[1, side, side]] * SQUARES)
    with torch.no_grad():
        worst = relative(encoder(rows, grids), expected)
    print(f"SigLIP + projector, TP 1: features vs transformers {worst:.1e}")
    assert worst <= TOLERANCE
    encoder.train()(rows, grids).square().sum().backward()
    # Every trainable parameter trains; SigLIP's post-layernorm is carried frozen, never run.
    untouched = [name for name, param in encoder.named_parameters()
                 if param.requires_grad and (param.grad is None or not param.grad.any())]
    assert untouched == [], untouched
    assert [name for name, param in encoder.named_parameters() if not param.requires_grad] == [
        "vision_model.post_layernorm.weight", "vision_model.post_layernorm.bias"]


def test_parameter_counts_equal_transformers():
    model_cfg = llava_onevision_model_cfg()
    model = llava_onevision_hf_model(model_cfg)
    vision, projector = parts.tower("siglip").parameters(model_cfg)
    assert vision == sum(p.numel() for p in model.model.vision_tower.parameters())
    assert projector == sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert LLAVA_ONEVISION_VISION.parameters(model_cfg) == (vision, projector + model.model.image_newline.numel())


# llava-hf/llava-onevision-qwen2-{7b,72b}-ov-hf: SigLIP-so400m at 384 px, its last 26 layers' worth
# (the published config keeps 26 of so400m's 27), into Qwen2-7B's (3584) or Qwen2-72B's (8192) width.
PUBLISHED_SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                        image_size=384, patch_size=14)


@pytest.mark.parametrize("text_hidden", [3584, 8192], ids=["7b", "72b"])
def test_published_sizes_count_as_transformers_builds_them(text_hidden):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    vision = PUBLISHED_SIGLIP
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                           vision_use_head=False, **vision),
        text_config=dict(model_type="qwen2", hidden_size=text_hidden, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, intermediate_size=64, vocab_size=128))
    with torch.device("meta"):
        model = LlavaOnevisionForConditionalGeneration(config)
    model_cfg = llava_onevision_model_cfg()
    model_cfg.vision = VisionConfig(arch="siglip", depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
                                    intermediate_size=vision["intermediate_size"],
                                    num_heads=vision["num_attention_heads"], patch_size=14, temporal_patch_size=1,
                                    image_size=384, window=None,
                                    hidden_act="gelu_pytorch_tanh", norm="layer")
    model_cfg.projector.out_hidden_size = text_hidden
    tower, projector = LLAVA_ONEVISION_VISION.parameters(model_cfg)
    hf_tower = sum(p.numel() for p in model.model.vision_tower.parameters())
    print(f"LLaVA-OneVision {text_hidden}: SigLIP {tower:,} (its post-norm carried, never run), projector {projector:,}")
    assert tower == hf_tower
    assert projector == (sum(p.numel() for p in model.model.multi_modal_projector.parameters())
                         + model.model.image_newline.numel())
