"""InternVL's tiles equal transformers' InternVL image processing bit for bit on real photos of
different sizes and aspect ratios (``GotOcr2ImageProcessorPil`` with InternVL3.5's settings: 448 px
tiles, 1-12 of them, a thumbnail, ImageNet's mean and std): pixel values, tile counts and the
placeholder tokens the processor writes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from loongforge.models.vlm.pixels import patch_rows
from loongforge.models.towers.intern_vit.processor import (
    TileSettings,
    preprocess_tiles,
    tile_count,
    tokens_per_tile,
)
from tests.shared_data import SHARED_DATA

SETTINGS = TileSettings()
PHOTOS = [SHARED_DATA / "coco2017" / "val2017" / name for name in sorted(
    p.name for p in (SHARED_DATA / "coco2017" / "val2017").glob("*.jpg"))[:3]]
DEMO = sorted((SHARED_DATA / "llamafactory" / "mllm_demo_data").glob("*.jpg"))


def transformers_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1,
                                    max_patches=12, image_mean=list(SETTINGS.mean), image_std=list(SETTINGS.std))


@pytest.mark.parametrize("path", [*PHOTOS, *DEMO[:2]], ids=lambda p: p.name)
def test_tiles_equal_transformers_bit_for_bit(path):
    image = Image.open(path).convert("RGB")
    expected = transformers_processor()(images=[image], return_tensors="np")
    ours = preprocess_tiles(image, SETTINGS)
    print(f"{path.name} {image.width}x{image.height}: {ours.shape[0]} tiles")
    assert ours.shape[0] == int(expected["num_patches"][0]) == tile_count(image.width, image.height, SETTINGS)
    assert ours.dtype == expected["pixel_values"].dtype and np.array_equal(ours, expected["pixel_values"])


def test_a_wide_image_tiles_by_its_aspect_ratio_and_adds_a_thumbnail():
    image = Image.new("RGB", (1800, 400), (120, 30, 200))
    assert tile_count(1800, 400, SETTINGS) == preprocess_tiles(image, SETTINGS).shape[0]
    expected = transformers_processor()(images=[image], return_tensors="np")
    assert preprocess_tiles(image, SETTINGS).shape[0] == int(expected["num_patches"][0]) > 2


def test_a_tile_is_256_tokens_at_448_pixels_and_its_rows_follow_the_patch_grid():
    assert tokens_per_tile(448, 14) == 256
    tiles = np.arange(2 * 3 * 28 * 28, dtype=np.float32).reshape(2, 3, 28, 28)
    rows = patch_rows(tiles, 14)  # [2 tiles x 4 patches, 3 * 14 * 14]
    assert rows.shape == (8, 588)
    assert np.array_equal(rows[5].reshape(3, 14, 14), tiles[1, :, 0:14, 14:28])  # tile 1, patch (0, 1)
