"""InternVL's vision part (``models/towers/intern_vit``) composed with the shared decoder (Qwen3 blocks,
1-D RoPE) by ``vlm.build_vlm``: the logits of a tiny random InternVL equal transformers'
``InternVLForConditionalGeneration`` at fp32 on a row holding two real photos of different proportions
(tiled by ``towers/intern_vit/processor.py`` at the tiny tile size), at TP 1 and at
TP 2 (vision TP 1 and 2), every parameter randomised (layer scales, class token, positions, norms); the
weights reach our model through the tower's HF rows and the decoder's; every parameter gets a
gradient. (The tower alone, its config and counts: ``tests/models/towers/test_intern_vit.py``.)

The composition is built directly and loaded through the InternVL family's rows (transformers 5's key
style); the family end to end (config.json, chat, processor, convert, training): tests/convert/ and
tests/train/test_composed_families_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from loongforge.config.schema import LanguageConfig, ModelConfig, ParallelConfig, ProjectorConfig, TokenIdsConfig
from loongforge.config.schema import VisionConfig
from loongforge.models import parts
from loongforge.models.registry import get_family
from loongforge.models.vlm.pixels import patch_rows
from loongforge.models.towers.intern_vit.processor import TileSettings, preprocess_tiles, tokens_per_tile
from loongforge.models.vlm.model import build_vlm
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.tower_helpers import load_rows, randomised, relative
from tests.shared_data import SHARED_DATA

TOLERANCE = 1e-5
VOCAB, IMAGE_TOKEN = 1000, 999
SIDE_PIXELS, PATCH = 56, 14  # 4 x 4 patches a tile, 2 x 2 = 4 tokens after the pixel shuffle
# Two COCO photos of different proportions, 640 x 457 and 480 x 640: 2 x 2 tiles and a thumbnail each.
PHOTOS = [SHARED_DATA / "coco2017" / "val2017" / name for name in ("000000020247.jpg", "000000012280.jpg")]


def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(
        family="internvl",
        vision=VisionConfig(arch="intern_vit", depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                            in_channels=3, patch_size=PATCH, temporal_patch_size=1, image_size=SIDE_PIXELS,
                            window_size=None, fullatt_block_indexes=[], rms_norm_eps=1e-6, hidden_act="gelu",
                            norm="layer"),
        projector=ProjectorConfig(arch="pixel_shuffle_mlp", spatial_merge_size=2, hidden_act="gelu",
                                  out_hidden_size=64),
        language=LanguageConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                num_query_groups=2, head_dim=16, qk_norm=True, add_qkv_bias=False,
                                vocab_size=VOCAB, rope_theta=1e6, mrope_section=[], tie_word_embeddings=False),
        tokens=TokenIdsConfig(image_token_id=IMAGE_TOKEN, video_token_id=998, vision_start_token_id=997,
                              vision_end_token_id=996, pad_token_id=0),
        layer_backend="sdpa",
    )


def hf_model(seed: int = 0):
    """transformers' tiny InternVL with every parameter drawn at random."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    config = InternVLConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=[SIDE_PIXELS, SIDE_PIXELS], patch_size=[PATCH, PATCH], attention_bias=True,
                           use_qk_norm=False, norm_type="layer_norm", layer_norm_eps=1e-6, use_mean_pooling=True,
                           hidden_act="gelu"),
        text_config=dict(model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         tie_word_embeddings=False),
        image_token_id=IMAGE_TOKEN, downsample_ratio=0.5, projector_hidden_act="gelu", tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomised(InternVLForConditionalGeneration(config).eval())


def sample() -> dict:
    """A row: text, a real photo's tiles (our processor at the tiny tile size: the grid and the
    thumbnail), text, another photo of other proportions, text."""
    g = torch.Generator().manual_seed(1)
    settings = TileSettings(size=SIDE_PIXELS, max_tiles=4)
    tiles = [torch.from_numpy(preprocess_tiles(Image.open(path).convert("RGB"), settings)) for path in PHOTOS]
    pieces = []
    for image_tiles in tiles:
        count = image_tiles.shape[0] * tokens_per_tile(SIDE_PIXELS, PATCH)
        pieces += [torch.randint(0, 990, (5,), generator=g), torch.full((count,), IMAGE_TOKEN)]
    input_ids = torch.cat([*pieces, torch.randint(0, 990, (4,), generator=g)])[None]
    return {"input_ids": input_ids, "pixels": torch.cat(tiles)}


def pixel_rows(pixels: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(patch_rows(pixels.numpy(), PATCH))


def rules(model_cfg):
    return get_family("internvl").hf_rules(model_cfg)


def build(model_cfg, parallel_cfg):
    return build_vlm(model_cfg, parallel_cfg, parts.tower("intern_vit"), side_sets=0, merge_unit=4,
                     params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu",
                     init_seed=3, rope="rope").eval()


def our_logits(model, row: dict) -> torch.Tensor:
    """[s, V] logits, gathered over TP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq_len = row["input_ids"].shape[1]
    tiles = row["pixels"].shape[0]
    side = SIDE_PIXELS // PATCH
    with torch.no_grad():
        logits = model(input_ids=row["input_ids"], position_ids=torch.arange(seq_len).expand(3, 1, seq_len),
                       pixel_values=pixel_rows(row["pixels"]),
                       image_grid_thw=torch.tensor([[1, side, side]] * tiles))
        logits = gather_from_tensor_model_parallel_region(logits, group=model.language_model.pg_collection.tp)
    return logits[0, :, :VOCAB]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """transformers' logits and weights of the tiny model, saved for the in-process and TP 2 runs."""
    model, row = hf_model(), sample()
    with torch.no_grad():
        logits = model(input_ids=row["input_ids"], pixel_values=row["pixels"]).logits[0]
    path = tmp_path_factory.mktemp("internvl") / "reference.pt"
    torch.save({"state": model.state_dict(), "row": row, "logits": logits}, path)
    return path


def test_logits_equal_transformers_at_tp1(megatron_world_of_one, reference):
    data = torch.load(reference, weights_only=False)
    model_cfg = tiny_model_cfg()
    model = build(model_cfg, ParallelConfig())
    load_rows(model, data["state"], model_cfg, rules(model_cfg))
    worst = relative(our_logits(model, data["row"]), data["logits"])
    print(f"InternVL tiny, TP 1: logits vs transformers {worst:.1e}")
    assert worst <= TOLERANCE
    # Every parameter trains: layer scales, class token and position table included.
    row, side = data["row"], SIDE_PIXELS // PATCH
    seq_len = row["input_ids"].shape[1]
    loss = model.train()(input_ids=row["input_ids"], position_ids=torch.arange(seq_len).expand(3, 1, seq_len),
                         labels=row["input_ids"], pixel_values=pixel_rows(row["pixels"]),
                         image_grid_thw=torch.tensor([[1, side, side]] * row["pixels"].shape[0]))
    loss.sum().backward()
    untouched = [name for name, param in model.named_parameters() if param.grad is None or not param.grad.any()]
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
        model = build(model_cfg, parallel_cfg)
        load_rows(model, data["state"], model_cfg, rules(model_cfg))
        worst[vision_tp] = relative(our_logits(model, data["row"]), data["logits"])
    torch.save(worst, Path(path).with_name(f"worst_{rank}.pt"))
    destroy_megatron()


def test_logits_equal_transformers_at_tp2(reference):
    run_workers(_tp2_worker, 2, (free_port(), str(reference)), timeout_s=300)
    for rank in range(2):
        worst = torch.load(reference.with_name(f"worst_{rank}.pt"))
        print(f"InternVL tiny, TP 2, rank {rank}: logits vs transformers at vision TP 1 {worst[1]:.1e}, "
              f"vision TP 2 {worst[2]:.1e}")
        assert max(worst.values()) <= TOLERANCE
