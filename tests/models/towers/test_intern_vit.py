"""InternVL3.5's vision part on its own, against transformers 5.25 as the reference:

- the processor's tiling and tile counts follow ``GotOcr2ImageProcessorPil`` (the PIL sibling of the
  torchvision-backed ``GotOcr2ImageProcessor`` that ``InternVLProcessor`` loads) on many sizes, and
  its placeholder text is InternVLProcessor's (its pixels on real photos:
  ``tests/models/test_intern_vit_processor.py``);
- InternViT + the pixel-shuffle projector (``towers/intern_vit/vision.py``), loaded through the HF
  rows, give transformers' ``InternVLModel.get_image_features`` (and every parameter's gradient) on
  the processor's 448-pixel tile of a photo at fp32, every parameter randomised, at vision TP 1 in
  process and TP 2 over gloo; every parameter (layer scales included) gets a gradient (many tiles of
  photos of other proportions in one row, composed with the decoder: the ``internvl`` reference of
  ``tests/models/references.py``, at the tiny tile);
- parameter counts, HF tensor shapes and FLOPs by arithmetic equal transformers' modules on the meta
  device (tiny, InternVL3.5-8B's and -38B's towers) and torch's FLOP counter;
- the HF rows round-trip (TP 2 shards back to the HF tensors, bit-exact);
- ``InternViTConfig`` reads and writes transformers' ``InternVLVisionConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from loongforge.config.schema import LanguageConfig, ModelConfig, TokenIdsConfig
from loongforge.models.flops import FlopOptions
from loongforge.models.hf.weights import hf_to_megatron
from loongforge.models.vlm.pixels import patch_rows
from loongforge.models.towers.intern_vit import flops, params, processor
from loongforge.models.towers.intern_vit.config import (
    INTERNVL3_5_8B_TEXT_HIDDEN,
    INTERNVL3_5_8B_VISION,
    INTERNVL3_5_38B_TEXT_HIDDEN,
    INTERNVL3_5_38B_VISION,
    InternViTConfig,
)
from loongforge.models.towers.intern_vit.hf_mapping import hf_shapes, tower_rules
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.shared_data import SHARED_DATA as DATA

WIDE = DATA / "coco2017/val2017/000000020247.jpg"  # 640 x 457
SMALL_WIDE = DATA / "llamafactory/mllm_demo_data/1.jpg"  # 300 x 168
# The parity runs keep the tile count small (a tiny tower still attends over 1,025 tokens a tile): the
# wide photo at 2 tiles at most is one tile.
FEATURE_MAX_TILES = 2
TINY = InternViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       attention_bias=True)
# InternViT-6B's block kinds at the tiny size: RMSNorm, q, k, v without bias, q/k norms over all heads.
TINY_6B = dataclasses.replace(TINY, norm_type="rms_norm", attention_bias=False, use_qk_norm=True)
VARIANTS = {"300M-like": TINY, "6B-like": TINY_6B}
TINY_TEXT_HIDDEN = 64
# Worst relative differences (to the largest reference value; for gradients, per parameter), about
# 3x the measured (one tile): features 7.7e-07 (2.0e-06 absolute), gradients 1.7e-06 (4.5e-08 absolute).
TOLERANCE = {"features": 2e-6, "gradients": 5e-6}


def tiny_model_cfg(config: InternViTConfig = TINY) -> ModelConfig:
    """The run's config of ``config``'s tower."""
    vision, projector = config.to_schema(TINY_TEXT_HIDDEN)
    return ModelConfig(
        family="qwen2_5_vl",  # the HF key style the rows are read through until InternVL's family exists
        vision=vision, projector=projector,
        language=LanguageConfig(num_layers=1, hidden_size=TINY_TEXT_HIDDEN, ffn_hidden_size=128,
                                num_attention_heads=4, num_query_groups=2, vocab_size=100, mrope_section=[]),
        tokens=TokenIdsConfig(image_token_id=99, video_token_id=98, vision_start_token_id=97,
                              vision_end_token_id=96, pad_token_id=0),
        layer_backend="sdpa",
    )


def reference_image_processor(max_tiles: int):
    """transformers' InternVL image processor (PIL backend) with the -HF checkpoints' settings."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=max_tiles,
        image_mean=list(processor.IMAGENET_MEAN), image_std=list(processor.IMAGENET_STD), resample=3,
        rescale_factor=1 / 255)


def hf_model(seed: int = 0, vision: InternViTConfig = TINY):
    """transformers' tiny InternVLModel, every parameter drawn at random (norms around 1, the rest
    around 0: layer scales, class token and positions are not their initial values)."""
    from transformers import InternVLConfig, InternVLModel

    config = InternVLConfig(
        vision_config=vision.to_hf(),
        text_config=dict(model_type="qwen2", vocab_size=100, hidden_size=TINY_TEXT_HIDDEN, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        downsample_ratio=TINY.downsample_ratio, projector_hidden_act=TINY.projector_hidden_act)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = InternVLModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * torch.randn_like(param))
    return model


def vision_state(model) -> dict:
    """The tower's and projector's tensors under ``InternVLForConditionalGeneration``'s names."""
    return {f"model.{name}": tensor for name, tensor in model.state_dict().items()
            if name.startswith(("vision_tower.", "multi_modal_projector."))}


def feature_tiles() -> torch.Tensor:
    """The processor's tiles of a photo: [1, 3, 448, 448]."""
    settings = processor.TileSettings(max_tiles=FEATURE_MAX_TILES)
    return torch.cat([torch.from_numpy(processor.preprocess_tiles(Image.open(path).convert("RGB"), settings))
                      for path in (WIDE,)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """transformers' features of the photo's tiles, the gradients of their mean square and the
    weights, each variant, for TP 1 and 2."""
    tiles, variants = feature_tiles(), {}
    for name, config in VARIANTS.items():
        model = hf_model(vision=config)
        features = model.get_image_features(pixel_values=tiles).pooler_output  # [tiles, 256, text]
        features.square().mean().backward()
        grads = {f"model.{key}": param.grad for key, param in model.named_parameters()
                 if key.startswith(("vision_tower.", "multi_modal_projector."))}
        variants[name] = {"state": vision_state(model), "features": features.detach(), "grads": grads}
    path = tmp_path_factory.mktemp("intern_vit") / "reference.pt"
    torch.save({"tiles": tiles, "variants": variants}, path)
    return path


def rules(config: InternViTConfig):
    return tower_rules(tiny_model_cfg(config))


def build_encoder(config: InternViTConfig):
    """The InternVL encoder (tower + projector) as a run builds it, over megatron's TP group, fp32 on
    the CPU (InternViT-6B's q/k norm and unbiased qkv from ``model.vision.qk_norm`` / ``qkv_bias``)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from loongforge.models.layers.layer_backend import block_modules, resolve_layer_backend
    from loongforge.models.towers.intern_vit.encoder import InternVLEncoder
    from loongforge.models.vlm.vision_common import vision_pg_collection
    from loongforge.models.vlm.encoder import EncoderBuild
    from loongforge.parallel import mcore_patches

    mcore_patches.apply_cpu()
    tp = parallel_state.get_tensor_model_parallel_group()
    model_cfg = tiny_model_cfg(config)
    pgs = vision_pg_collection(tp, ProcessGroupCollection.use_mpu_process_groups())
    modules = block_modules(resolve_layer_backend(model_cfg.layer_backend, torch.device("cpu"), torch.float32))
    return InternVLEncoder.build(EncoderBuild(
        model_cfg=model_cfg, vision_tp=tp.size(), tp_group=tp, pgs=pgs, modules=modules,
        params_dtype=torch.float32, on_cpu=True, recompute=False, init_seed=3))


def load(encoder, hf_state: dict, config: InternViTConfig) -> None:
    """HF tensors -> this TP rank's shards, through the tower's rows."""
    from megatron.core import parallel_state

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    converted = hf_to_megatron(hf_state, tiny_model_cfg(config), list(encoder.state_dict()), vision_tp_rank=rank,
                               vision_tp_size=size, rules=rules(config))
    result = encoder.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def our_features(encoder, tiles: torch.Tensor) -> torch.Tensor:
    """[tiles, 256, text] features of the encoder."""
    rows = torch.from_numpy(patch_rows(tiles.numpy(), TINY.patch_size))
    grids = torch.tensor([[1, TINY.patches_per_side, TINY.patches_per_side]] * tiles.shape[0])
    return encoder(rows, grids).view(tiles.shape[0], TINY.tokens_per_tile, -1)


def worst_difference(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max absolute difference, that relative to the largest reference value)."""
    absolute = float((ours - reference).abs().max())
    return absolute, absolute / float(reference.abs().max())


# --------------------------------------------------------------------------------------------------
# Processor
# --------------------------------------------------------------------------------------------------


def test_tiling_follows_transformers_on_many_sizes():
    """The grid choice (ties included) and the tile count, for sizes no photo here has."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    sizes = [(w, h) for w in (100, 224, 448, 500, 896, 1000, 1344, 2000, 3000) for h in (80, 224, 448, 672, 897, 1800)]
    for max_tiles in (2, 12):
        reference, settings = reference_image_processor(max_tiles), processor.TileSettings(max_tiles=max_tiles)
        for width, height in sizes:
            assert processor.tile_count(width, height, settings) == \
                reference.get_number_of_image_patches(height, width), (width, height, max_tiles)
            assert processor.tile_grid(width, height, settings) == get_optimal_tiled_canvas(
                (height, width), (448, 448), 1, max_tiles)


def test_placeholder_is_what_internvl_processor_writes():
    from transformers import InternVLProcessor

    tiles = processor.tile_count(*Image.open(SMALL_WIDE).size, processor.TileSettings())
    # InternVLProcessor's method on a stand-in carrying the -HF tokenizer's three image tokens.
    tokens = SimpleNamespace(start_image_token="<img>", image_token="<IMG_CONTEXT>", end_image_token="</img>",
                             image_seq_length=processor.tokens_per_tile(448, 14))
    written = InternVLProcessor.replace_image_token(tokens, {"num_patches": [tiles]}, 0)
    assert processor.image_placeholder(tiles) == written
    assert written.count("<IMG_CONTEXT>") == 3 * 256


# --------------------------------------------------------------------------------------------------
# Tower + projector against transformers
# --------------------------------------------------------------------------------------------------


def our_worst(config: InternViTConfig, data: dict) -> dict[str, tuple[float, float]]:
    """Build ``config``'s encoder at this TP layout, load transformers' weights, compare the features
    and every parameter's gradient of their mean square (transformers' sharded through the rows)."""
    from megatron.core import parallel_state

    variant = data["variants"][next(name for name, known in VARIANTS.items() if known == config)]
    encoder = build_encoder(config).eval()
    load(encoder, variant["state"], config)
    features = our_features(encoder, data["tiles"])
    features.square().mean().backward()
    expected = hf_to_megatron(variant["grads"], tiny_model_cfg(config), [key for key, _ in encoder.named_parameters()],
                              vision_tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                              vision_tp_size=parallel_state.get_tensor_model_parallel_world_size(), rules=rules(config))
    grads = [worst_difference(param.grad, expected[key]) for key, param in encoder.named_parameters()]
    return {"features": worst_difference(features.detach(), variant["features"]),
            "gradients": (max(a for a, _ in grads), max(r for _, r in grads))}


@pytest.mark.parametrize("name", VARIANTS)
def test_features_equal_transformers_at_tp1(megatron_world_of_one, reference, name):
    data = torch.load(reference, weights_only=False)
    for what, (absolute, relative) in our_worst(VARIANTS[name], data).items():
        print(f"InternViT tiny {name} + projector, {data['tiles'].shape[0]} tiles of a photo, TP 1: {what} "
              f"max abs {absolute:.1e}, relative {relative:.1e} (asserted {TOLERANCE[what]:.1e})")
        assert relative <= TOLERANCE[what]


@pytest.mark.parametrize("name", VARIANTS)
def test_every_parameter_gets_a_gradient(megatron_world_of_one, name):
    """Layer scales, class token, positions, norms (q/k norms too) and the projector all train."""
    config = VARIANTS[name]
    encoder = build_encoder(config).train()
    our_features(encoder, feature_tiles()[:1]).square().mean().backward()
    untouched = [key for key, param in encoder.named_parameters() if param.grad is None or not param.grad.any()]
    assert not untouched, untouched
    keys = [key for key, _ in encoder.named_parameters()]
    assert sum(key.endswith("layer_scale") for key in keys) == 2 * config.num_hidden_layers
    assert sum(key.endswith("q_layernorm.weight") for key in keys) == (2 if config.use_qk_norm else 0)
    assert sum(key.endswith("linear_qkv.bias") for key in keys) == (2 if config.attention_bias else 0)


def _qk_norm_shards(config) -> list[tuple[str, bool, tuple[int, ...]]]:
    """Each q/k norm weight of ``config``'s encoder at this TP layout: (name, split over TP for the grad norm and
    the optimizer, the shape its checkpoint tensor has across the TP group)."""
    encoder = build_encoder(config)
    norms = [(name, module) for name, module in encoder.named_modules() if name.endswith(("q_layernorm", "k_layernorm"))]
    return [(name, bool(getattr(module.weight, "tensor_model_parallel", False)),
             tuple(module.sharded_state_dict(f"{name}.")[f"{name}.weight"].global_shape)) for name, module in norms]


def _tp2_worker(rank: int, port: int, path: str) -> None:
    limit_threads()
    init_megatron(rank, 2, port, tp=2)
    data = torch.load(path, weights_only=False)
    worst = {name: our_worst(config, data) for name, config in VARIANTS.items()}
    torch.save(worst, Path(path).with_name(f"worst_{rank}.pt"))
    torch.save(_qk_norm_shards(TINY_6B), Path(path).with_name(f"qk_norms_{rank}.pt"))
    destroy_megatron()


def test_features_equal_transformers_at_tp2(reference):
    """Also: InternViT-6B's q/k norms over all heads, split over TP, count as split (the grad norm sums every
    rank's part) and checkpoint as one tensor of the whole width, each rank its part."""
    run_workers(_tp2_worker, 2, (free_port(), str(reference)), timeout_s=300)
    width = TINY_6B.num_attention_heads * (TINY_6B.hidden_size // TINY_6B.num_attention_heads)
    for rank in range(2):
        norms = torch.load(reference.with_name(f"qk_norms_{rank}.pt"))
        print(f"rank {rank}: q/k norms {norms}")
        assert len(norms) == 2 * TINY_6B.num_hidden_layers
        assert all(split and shape == (width,) for _, split, shape in norms)
    for rank in range(2):
        for name, worst in torch.load(reference.with_name(f"worst_{rank}.pt")).items():
            for what, (absolute, relative) in worst.items():
                print(f"InternViT tiny {name} + projector, TP 2, rank {rank}: {what} max abs {absolute:.1e}, "
                      f"relative {relative:.1e} (asserted {TOLERANCE[what]:.1e})")
                assert relative <= TOLERANCE[what]


# --------------------------------------------------------------------------------------------------
# Counts, shapes and weight rows
# --------------------------------------------------------------------------------------------------

TOWERS = {"tiny": (TINY, TINY_TEXT_HIDDEN), "InternVL3.5-8B": (INTERNVL3_5_8B_VISION, INTERNVL3_5_8B_TEXT_HIDDEN),
          "InternVL3.5-38B": (INTERNVL3_5_38B_VISION, INTERNVL3_5_38B_TEXT_HIDDEN)}


def meta_modules(config: InternViTConfig, text_hidden: int):
    """transformers' vision tower and projector for ``config`` on the meta device (no memory)."""
    from transformers import InternVLConfig
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector, InternVLVisionModel

    composed = InternVLConfig(vision_config=config.to_hf(),
                              text_config=dict(model_type="qwen2", hidden_size=text_hidden, num_attention_heads=8),
                              downsample_ratio=config.downsample_ratio)
    with torch.device("meta"):
        return InternVLVisionModel(composed.vision_config), InternVLMultiModalProjector(composed)


@pytest.mark.parametrize("name", TOWERS)
def test_parameter_counts_and_shapes_equal_transformers(name):
    config, text_hidden = TOWERS[name]
    tower, projector = meta_modules(config, text_hidden)
    expected = (sum(p.numel() for p in tower.parameters()), sum(p.numel() for p in projector.parameters()))
    ours = (params.tower_parameters(config), params.projector_parameters(config, text_hidden))
    print(f"{name}: tower {ours[0]:,}, projector {ours[1]:,} parameters (transformers {expected[0]:,}, "
          f"{expected[1]:,})")
    assert ours == expected
    shapes = {**{f"model.vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()},
              **{f"model.multi_modal_projector.{k}": tuple(v.shape) for k, v in projector.state_dict().items()}}
    assert hf_shapes(config, text_hidden) == shapes


@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
def test_part_counts_agree_with_the_hf_config_counts(norm_type):
    """The registered part's count (from the run's ModelConfig) equals the HF config's."""
    config = dataclasses.replace(TINY, norm_type=norm_type)
    model_cfg = tiny_model_cfg(config)
    assert InternViTConfig.from_schema(model_cfg.vision, model_cfg.projector) == config
    vision, projector = params.encoder_parameters(model_cfg)
    assert (vision, projector) == (params.tower_parameters(config),
                                   params.projector_parameters(config, TINY_TEXT_HIDDEN))


def megatron_keys(config: InternViTConfig) -> list[str]:
    """Our keys the rows name, every block index filled in."""
    keys = []
    for rule in rules(config):
        indices = range(config.num_hidden_layers) if "{i}" in rule.megatron else [None]
        keys += [rule.megatron if i is None else rule.megatron.format(i=i) for i in indices]
    return keys


def unshard(shards: list[dict], config: InternViTConfig) -> dict:
    """Every TP rank's tensors -> the HF tensors, row by row (``hf_weights.megatron_to_hf`` walks
    given rules as LoRA adapters' only, so the rows are walked here)."""
    out = {}
    for rule in rules(config):
        indices = range(config.num_hidden_layers) if "{i}" in rule.megatron else [None]
        for i in indices:
            key = rule.megatron if i is None else rule.megatron.format(i=i)
            tensors = rule.transform.unshard([shard[key] for shard in shards])
            out.update({(pattern if i is None else pattern.format(i=i)): tensor
                        for pattern, tensor in zip(rule.hf, tensors)})
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_hf_rows_round_trip_at_tp2(name):
    config = VARIANTS[name]
    hf_state = vision_state(hf_model(seed=5, vision=config))
    keys = megatron_keys(config)
    shards = [hf_to_megatron(hf_state, tiny_model_cfg(config), keys, vision_tp_rank=rank, vision_tp_size=2,
                             rules=rules(config)) for rank in range(2)]
    split = [key for key in keys if not torch.equal(shards[0][key], shards[1][key])]
    assert any("linear_fc1.weight" in key for key in split) and any("linear_qkv" in key for key in split)
    back = unshard(shards, config)
    assert sorted(back) == sorted(hf_state)
    unequal = [key for key in hf_state if not torch.equal(back[key], hf_state[key])]
    assert not unequal, unequal


# --------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------


def test_forward_flops_equal_torch_flop_counter():
    """Patch embedding, blocks (attention per tile with its class token) and projector: the forward
    equals what torch's FlopCounterMode counts on transformers' tiny model (2 tiles)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, tiles = hf_model(), torch.zeros(2, 3, 448, 448)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.get_image_features(pixel_values=tiles)
    ours = sum(flops.tile_forward_flops(TINY, 2, TINY_TEXT_HIDDEN))
    print(f"tiny, 2 tiles: forward {ours:,} FLOPs (torch counts {counter.get_total_flops():,})")
    assert ours == counter.get_total_flops()


def test_training_flops_follow_the_convention():
    embedding, blocks, projector = flops.tile_forward_flops(INTERNVL3_5_8B_VISION, 13, INTERNVL3_5_8B_TEXT_HIDDEN)
    vision, projected = flops.tile_flops(INTERNVL3_5_8B_VISION, 13, INTERNVL3_5_8B_TEXT_HIDDEN)
    assert (vision, projected) == (2 * embedding + 3 * blocks, 3 * projector)
    recomputed, _ = flops.tile_flops(INTERNVL3_5_8B_VISION, 13, INTERNVL3_5_8B_TEXT_HIDDEN, FlopOptions(recompute=True))
    assert recomputed == 2 * embedding + 4 * blocks
    # The part's count (ModelConfig, grids of tiles) is the same number.
    model_cfg = tiny_model_cfg()
    side = TINY.patches_per_side
    assert flops.encoder_flops(model_cfg, [(1, side, side)] * 3, FlopOptions()) == \
        flops.tile_flops(TINY, 3, TINY_TEXT_HIDDEN)
    # A 448-pixel tile of InternViT-300M: about 0.73 TFLOPs forward (1,025 tokens through 24 blocks).
    assert math.isclose(sum(flops.tile_forward_flops(INTERNVL3_5_8B_VISION, 1, 4096)) / 1e12, 0.73, rel_tol=0.05)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def test_config_reads_and_writes_transformers_vision_config():
    from transformers import InternVLVisionConfig

    for config in (TINY, INTERNVL3_5_8B_VISION, INTERNVL3_5_38B_VISION):
        hf = InternVLVisionConfig(**config.to_hf())
        assert InternViTConfig.from_hf(hf.to_dict()) == config
    # A config.json that omits keys reads as transformers reads it.
    assert InternViTConfig.from_hf(InternVLVisionConfig().to_dict()) == InternViTConfig.from_hf({})
    assert INTERNVL3_5_8B_VISION.tokens_per_tile == 256 and INTERNVL3_5_38B_VISION.head_dim == 128


@pytest.mark.parametrize("key, value", [("norm_type", "batch_norm"), ("image_size", [448, 224]),
                                        ("num_attention_heads", 5), ("use_mean_pooling", False),
                                        ("hidden_act", "silu")])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"config\.json vision_config\.{key}="):
        InternViTConfig.from_hf({**INTERNVL3_5_8B_VISION.to_hf(), key: value}, "config.json vision_config")


def test_the_38b_tower_reaches_a_run_through_the_schema():
    vision, projector = INTERNVL3_5_38B_VISION.to_schema(INTERNVL3_5_38B_TEXT_HIDDEN)
    assert (vision.qkv_bias, vision.qk_norm, vision.norm) == (False, True, "rms")
    assert InternViTConfig.from_schema(vision, projector) == INTERNVL3_5_38B_VISION
