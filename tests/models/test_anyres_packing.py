"""LLaVA-OneVision's anyres packing equals transformers' ``LlavaOnevisionModel.pack_image_features``
exactly (the same float operations) for images of many proportions, crops unpadded and, past
``anyres_max_9``, shrunk bilinearly; a one-square image is its patches and a newline; and the packed
length is the processor's token count for the image, so placeholders and features always agree."""

from __future__ import annotations

import pytest
import torch

from loongforge.models.llava_onevision.packing import pack_anyres
from loongforge.models.llava_onevision.anyres import AnyresSettings, anyres_tokens, best_canvas

SETTINGS = AnyresSettings()
PATCH, HIDDEN = 14, 8
SIDE = SETTINGS.size // PATCH  # 27 patches a crop side


def transformers_pack(features: torch.Tensor, image_size: tuple[int, int], newline: torch.Tensor) -> torch.Tensor:
    from transformers import LlavaOnevisionConfig
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    config = LlavaOnevisionConfig(vision_config=dict(model_type="siglip_vision_model", image_size=384, patch_size=14),
                                  image_grid_pinpoints=[list(p) for p in SETTINGS.grid_pinpoints])
    model = type("Shim", (), {"config": config})()  # pack_image_features reads only self.config
    packed, _ = LlavaOnevisionModel.pack_image_features(model, [features], torch.tensor([image_size]), newline)
    return packed[0]  # one image


@pytest.mark.parametrize("image_size", [(480, 640), (457, 640), (168, 300), (400, 2200), (2300, 500), (1500, 1500)])
def test_packing_equals_transformers_and_the_processor_count(image_size):
    canvas = best_canvas(*image_size, SETTINGS)
    squares = 1 + (canvas[0] // SETTINGS.size) * (canvas[1] // SETTINGS.size)
    generator = torch.Generator().manual_seed(sum(image_size))
    features = torch.randn(squares, SIDE * SIDE, HIDDEN, generator=generator)
    newline = torch.randn(HIDDEN, generator=generator)
    ours = pack_anyres(features, image_size, newline, SETTINGS, PATCH)
    assert torch.equal(ours, transformers_pack(features, image_size, newline))
    assert ours.shape[0] == anyres_tokens(*image_size, SETTINGS, PATCH)


def test_an_image_of_one_square_is_its_patches_and_a_newline():
    features, newline = torch.randn(1, SIDE * SIDE, HIDDEN), torch.randn(HIDDEN)
    ours = pack_anyres(features, (300, 500), newline, SETTINGS, PATCH)
    assert torch.equal(ours, transformers_pack(features, (300, 500), newline))
    assert torch.equal(ours[-1], newline) and ours.shape[0] == SIDE * SIDE + 1
