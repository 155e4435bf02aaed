"""LLaVA-OneVision's vision part (``models/towers/siglip``: SigLIP and the MLP projector) equals
transformers' (``LlavaOnevisionModel``: the vision tower's last hidden state, then
``multi_modal_projector``) at fp32 on images whose side leaves pixels past the last whole patch, at
TP 1 (the encoder alone, as ``loongforge encode`` builds it) and at TP 2 inside the composition (vision
TP 1 and 2); every parameter randomised and every one trains; the parameter counts equal
transformers' (its unused post-layernorm apart). The anyres packing on top is the family's (to come).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from loongforge.config.schema import (
    LanguageConfig,
    ModelConfig,
    ParallelConfig,
    ProjectorConfig,
    TokenIdsConfig,
    VisionConfig,
)
from loongforge.models import parts
from loongforge.models.registry import get_family
from loongforge.models.vlm.pixels import patch_rows
from loongforge.models.towers.siglip.encoder import LlavaOnevisionEncoder
from loongforge.models.towers.siglip.processor import (
    AnyresSettings,
    anyres_crops,
    anyres_tokens,
    square_padded,
)
from loongforge.models.vlm.encoder import build_encoder_alone
from loongforge.models.vlm.model import build_vlm
from tests.models.helpers import (
    destroy_megatron,
    free_port,
    init_megatron,
    limit_threads,
    run_workers,
)
from tests.models.tower_helpers import load_rows, randomised, relative
from tests.shared_data import SHARED_DATA

TOLERANCE = 1e-5
VOCAB = 1000
SIDE_PIXELS, PATCH = 60, 14  # 4 x 4 whole patches; the last 4 pixels of each side are left out (valid conv)
IMAGES = 3
# Canvases of up to 3 x 2 squares of 60 px, as the published 384 px ones are of up to 6 x 6.
PINPOINTS = ((60, 60), (60, 120), (120, 60), (120, 120), (120, 180), (180, 120))
PHOTO = SHARED_DATA / "coco2017" / "val2017" / "000000020247.jpg"  # 640 x 457: 2 x 3 crops


def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(
        family="llava_onevision",
        vision=VisionConfig(arch="siglip", depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3,
                            patch_size=PATCH, temporal_patch_size=1, image_size=SIDE_PIXELS, window_size=None,
                            fullatt_block_indexes=[], rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", norm="layer",
                            anyres_pinpoints=[list(p) for p in PINPOINTS]),
        projector=ProjectorConfig(arch="mlp", spatial_merge_size=1, hidden_act="gelu", out_hidden_size=64),
        language=LanguageConfig(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=2, vocab_size=VOCAB, rope_theta=1e6, mrope_section=[],
                                add_qkv_bias=True, tie_word_embeddings=False),
        tokens=TokenIdsConfig(image_token_id=999, video_token_id=998, vision_start_token_id=997,
                              vision_end_token_id=996, pad_token_id=0),
        layer_backend="sdpa",
    )


def hf_model(seed: int = 0):
    """transformers' tiny LLaVA-OneVision with every parameter drawn at random."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, image_size=SIDE_PIXELS, patch_size=PATCH,
                           layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", vision_use_head=False),
        text_config=dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False),
        image_token_index=999, vision_feature_layer=-1, vision_feature_select_strategy="full",
        image_grid_pinpoints=[list(p) for p in PINPOINTS],
        projector_hidden_act="gelu", multimodal_projector_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(LlavaOnevisionForConditionalGeneration(config).eval())


def rules(model_cfg):
    return get_family("llava_onevision").hf_rules(model_cfg)


def rows_and_grids(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, C, S, S] -> pixel rows of the whole patches (row-major) and one (1, side, side) grid each."""
    side = SIDE_PIXELS // PATCH
    whole = pixels[..., :side * PATCH, :side * PATCH].contiguous().numpy()
    return torch.from_numpy(patch_rows(whole, PATCH)), torch.tensor([[1, side, side]] * pixels.shape[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """transformers' features and weights of the tiny model, for the in-process and TP 2 runs."""
    model = hf_model()
    pixels = torch.randn(IMAGES, 3, SIDE_PIXELS, SIDE_PIXELS, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        last = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]
        features = model.model.multi_modal_projector(last).reshape(-1, 64)  # [images * patches, LM hidden]
    path = tmp_path_factory.mktemp("siglip") / "reference.pt"
    torch.save({"state": model.state_dict(), "pixels": pixels, "features": features}, path)
    return path


def test_the_encoder_alone_equals_transformers_and_every_parameter_trains(megatron_world_of_one, reference):
    data = torch.load(reference, weights_only=False)
    model_cfg = tiny_model_cfg()
    encoder = build_encoder_alone(LlavaOnevisionEncoder.build, model_cfg, params_dtype=torch.float32, device="cpu")
    load_rows(encoder, data["state"], model_cfg, rules(model_cfg))
    rows, grids = rows_and_grids(data["pixels"])
    with torch.no_grad():
        worst = relative(encoder(rows, grids), data["features"])
    print(f"SigLIP + projector, TP 1: features vs transformers {worst:.1e}")
    assert worst <= TOLERANCE
    encoder.train()(rows, grids).square().sum().backward()
    # Every trainable parameter but the newline, which only packed features use, trains (the full model's
    # test sees it train); SigLIP's post-layernorm is carried frozen, never run.
    untouched = [name for name, param in encoder.named_parameters()
                 if param.requires_grad and (param.grad is None or not param.grad.any())]
    assert untouched == ["image_newline.weight"], untouched
    assert [name for name, param in encoder.named_parameters() if not param.requires_grad] == [
        "vision_model.post_layernorm.weight", "vision_model.post_layernorm.bias"]


def loaded_composition(hf, model_cfg: ModelConfig):
    """Our composition (TP 1) with ``hf``'s weights loaded through the family's rows."""
    model = build_vlm(model_cfg, ParallelConfig(encoder_cp=False), parts.tower("siglip"), side_sets=0, merge_unit=1,
                      rope="rope", params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu",
                      init_seed=3)
    load_rows(model, hf.state_dict(), model_cfg, rules(model_cfg))
    return model


def test_the_composition_with_anyres_packing_equals_transformers_on_a_real_photo(megatron_world_of_one):
    """A photo through our anyres processing, SigLIP, the projector and the packing into the Qwen2
    decoder: logits equal ``LlavaOnevisionForConditionalGeneration``'s, and every parameter trains."""
    model_cfg = tiny_model_cfg()
    settings = AnyresSettings(size=SIDE_PIXELS, grid_pinpoints=PINPOINTS)
    image = Image.open(PHOTO).convert("RGB")
    squares = torch.from_numpy(anyres_crops(image, settings))  # [1 + crops, 3, 60, 60]
    tokens = anyres_tokens(image.height, image.width, settings, PATCH)
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.cat([torch.randint(0, 990, (6,), generator=generator), torch.full((tokens,), 999),
                           torch.randint(0, 990, (5,), generator=generator)])[None]
    hf = hf_model()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, pixel_values=squares[None], image_sizes=torch.tensor([[image.height, image.width]]),
                      batch_num_images=torch.tensor([1])).logits[0]
    model = loaded_composition(hf, model_cfg)
    rows, _ = rows_and_grids(squares)
    side, seq_len = SIDE_PIXELS // PATCH, input_ids.shape[1]
    inputs = dict(input_ids=input_ids, position_ids=torch.arange(seq_len).expand(3, 1, seq_len), pixel_values=rows,
                  image_grid_thw=torch.tensor([[squares.shape[0], side, side]]),
                  image_sizes=torch.tensor([[image.height, image.width]]))
    with torch.no_grad():
        worst = relative(model.eval()(**inputs)[0, :, :VOCAB], expected)
    print(f"LLaVA-OneVision tiny, TP 1: {squares.shape[0]} squares, {tokens} image tokens, logits vs transformers "
          f"{worst:.1e}")
    assert worst <= TOLERANCE
    model.train()(**inputs, labels=input_ids).sum().backward()
    untouched = [name for name, param in model.named_parameters()
                 if param.requires_grad and (param.grad is None or not param.grad.any())]
    assert not untouched, untouched


def _tp2_worker(rank: int, port: int, path: str) -> None:
    limit_threads()
    init_megatron(rank, 2, port, tp=2)
    data = torch.load(path, weights_only=False)
    model_cfg = tiny_model_cfg()
    worst = {}
    for vision_tp in (1, 2):
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=2, vision_tensor_model_parallel_size=vision_tp,
                                      world_size=2)
        model = build_vlm(model_cfg, parallel_cfg, parts.tower("siglip"), side_sets=0, merge_unit=1, rope="rope",
                          params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu",
                          init_seed=3).eval()
        load_rows(model, data["state"], model_cfg, rules(model_cfg))
        with torch.no_grad():
            worst[vision_tp] = relative(model._encoder(*rows_and_grids(data["pixels"])), data["features"])
    torch.save(worst, Path(path).with_name(f"worst_{rank}.pt"))
    destroy_megatron()


def test_the_encoder_in_the_composition_equals_transformers_at_tp2(reference):
    run_workers(_tp2_worker, 2, (free_port(), str(reference)), timeout_s=300)
    for rank in range(2):
        worst = torch.load(reference.with_name(f"worst_{rank}.pt"))
        print(f"SigLIP + projector, TP 2, rank {rank}: vision TP 1 {worst[1]:.1e}, vision TP 2 {worst[2]:.1e}")
        assert max(worst.values()) <= TOLERANCE


def test_parameter_counts_equal_transformers():
    model, model_cfg = hf_model(), tiny_model_cfg()
    vision, projector = parts.tower("siglip").parameters(model_cfg)
    assert vision == sum(p.numel() for p in model.model.vision_tower.parameters())
    assert projector == (sum(p.numel() for p in model.model.multi_modal_projector.parameters())
                         + model.model.image_newline.numel())


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
    model_cfg = tiny_model_cfg()
    model_cfg.vision = VisionConfig(arch="siglip", depth=vision["num_hidden_layers"], hidden_size=vision["hidden_size"],
                                    intermediate_size=vision["intermediate_size"],
                                    num_heads=vision["num_attention_heads"], patch_size=14, temporal_patch_size=1,
                                    image_size=384, window_size=None, fullatt_block_indexes=[],
                                    hidden_act="gelu_pytorch_tanh", norm="layer")
    model_cfg.projector.out_hidden_size = text_hidden
    tower, projector = parts.tower("siglip").parameters(model_cfg)
    hf_tower = sum(p.numel() for p in model.model.vision_tower.parameters())
    print(f"LLaVA-OneVision {text_hidden}: SigLIP {tower:,} (its post-norm carried, never run), projector {projector:,}")
    assert tower == hf_tower
    assert projector == (sum(p.numel() for p in model.model.multi_modal_projector.parameters())
                         + model.model.image_newline.numel())


SECOND_PHOTO = SHARED_DATA / "coco2017" / "val2017" / "000000012280.jpg"  # 480 x 640: portrait, the other's landscape


def test_a_multi_image_sample_equals_transformers(megatron_world_of_one):
    """Two photos of different sizes in one sample: each a square padded in the mean colour (no anyres),
    its patches and the newline; logits equal ``LlavaOnevisionForConditionalGeneration``'s given the sample's
    image count (``batch_num_images``)."""
    model_cfg = tiny_model_cfg()
    settings = AnyresSettings(size=SIDE_PIXELS, grid_pinpoints=PINPOINTS)
    images = [Image.open(path).convert("RGB") for path in (PHOTO, SECOND_PHOTO)]
    squares = torch.cat([torch.from_numpy(square_padded(image, settings)) for image in images])  # [2, 3, 60, 60]
    side = SIDE_PIXELS // PATCH
    generator = torch.Generator().manual_seed(4)
    pieces = []
    for _ in images:
        pieces += [torch.randint(0, 990, (4,), generator=generator), torch.full((side * side + 1,), 999)]
    input_ids = torch.cat([*pieces, torch.randint(0, 990, (3,), generator=generator)])[None]
    sizes = torch.tensor([[image.height, image.width] for image in images])
    hf = hf_model()
    with torch.no_grad():
        expected = hf(input_ids=input_ids, pixel_values=squares[:, None], image_sizes=sizes,
                      batch_num_images=torch.tensor([2])).logits[0]
    model = loaded_composition(hf, model_cfg)
    rows, grids = rows_and_grids(squares)
    seq_len = input_ids.shape[1]
    with torch.no_grad():
        ours = model.eval()(input_ids=input_ids, position_ids=torch.arange(seq_len).expand(3, 1, seq_len),
                            pixel_values=rows, image_grid_thw=grids, image_sizes=sizes)[0, :, :VOCAB]
    worst = relative(ours, expected)
    print(f"LLaVA-OneVision tiny, a sample of two photos {[image.size for image in images]}: logits vs transformers "
          f"{worst:.1e}")
    assert worst <= TOLERANCE
