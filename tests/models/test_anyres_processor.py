"""LLaVA-OneVision's anyres processing equals transformers' bit for bit on real photos of different
sizes and proportions (``LlavaOnevisionImageProcessorPil`` with the published settings: 384 px, the
1-6 x 1-6 pinpoints, SigLIP's mean and std): the base image and every crop, and the square of an image that shares its sample; and the placeholder tokens
equal what transformers' ``LlavaOnevisionProcessor`` counts for each image (``anyres_max_9``)."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
from PIL import Image

from loongforge.models.llava_onevision.anyres import AnyresSettings, anyres_crops, anyres_tokens, square_padded
from tests.shared_data import SHARED_DATA

SETTINGS = AnyresSettings()
COCO = sorted((SHARED_DATA / "coco2017" / "val2017").glob("*.jpg"))[:3]
DEMO = sorted((SHARED_DATA / "llamafactory" / "mllm_demo_data").glob("*.jpg"))[:2]


def transformers_image_processor():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    return LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384}, image_mean=list(SETTINGS.mean),
                                           image_std=list(SETTINGS.std),
                                           image_grid_pinpoints=[list(p) for p in SETTINGS.grid_pinpoints])


def transformers_token_count(height: int, width: int) -> int:
    """``LlavaOnevisionProcessor._get_number_of_features`` on the published settings (no tokenizer needed)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    processor = types.SimpleNamespace(image_processor=transformers_image_processor(), num_image_tokens=729,
                                      vision_aspect_ratio="anyres_max_9")
    processor._get_unpadded_features = functools.partial(LlavaOnevisionProcessor._get_unpadded_features, processor)
    return LlavaOnevisionProcessor._get_number_of_features(processor, height, width, 384, 384)


@pytest.mark.parametrize("path", [*COCO, *DEMO], ids=lambda p: p.name)
def test_crops_and_tokens_equal_transformers(path):
    image = Image.open(path).convert("RGB")
    expected = transformers_image_processor()(images=[image], return_tensors="np")
    ours = anyres_crops(image, SETTINGS)
    tokens = anyres_tokens(image.height, image.width, SETTINGS, patch_size=14)
    print(f"{path.name} {image.width}x{image.height}: {ours.shape[0]} squares, {tokens} tokens")
    assert expected["pixel_values"].shape[1] == ours.shape[0]
    assert ours.dtype == expected["pixel_values"].dtype and np.array_equal(ours, expected["pixel_values"][0])
    assert tokens == transformers_token_count(image.height, image.width)


@pytest.mark.parametrize("size", [(400, 2200), (2300, 500), (1500, 1500), (60, 90)])
def test_token_counts_equal_transformers_across_proportions(size):
    height, width = size
    assert anyres_tokens(height, width, SETTINGS, patch_size=14) == transformers_token_count(height, width)


def test_images_sharing_a_sample_are_padded_to_squares_as_transformers_pads_them():
    images = [Image.open(path).convert("RGB") for path in (COCO[0], DEMO[0])]
    expected = transformers_image_processor()(images=[images], return_tensors="np")["pixel_values"]
    for index, image in enumerate(images):
        ours = square_padded(image, SETTINGS)
        assert np.array_equal(ours[0], expected[index, 0]), image.size
