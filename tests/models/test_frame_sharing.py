"""The rule ``parallel.encoder_cp`` and ``encoder_dp=tp`` rest on (``models.vlm.encoder_share``): each
family's vision tower encodes a video frame by frame, so encoding its frames as separate (1, h, w)
media, on any ranks, and concatenating the features equals encoding the video whole.

A tower that attended across frames (a 3-D window, a video-wide position table) would fail here, and
dealing a video's frames to different ranks would then train a different model.
"""

import pytest
import torch

from loongforge.config.schema import ParallelConfig
from loongforge.models.vlm.encoder_share import frame_grids
from loongforge.models.qwen2_5_vl.model import build_model as build_qwen2_5_vl
from loongforge.models.qwen3_vl.model import build_model as build_qwen3_vl
from tests.models import test_qwen3_vl_support as qwen3_vl_support
from tests.models.helpers import tiny_model_cfg

# An image, then a video of 3 temporal patches whose 8 x 12 frames tile into windows unevenly.
GRID_THW = torch.tensor([[1, 8, 8], [3, 8, 12]])
TOLERANCE = 1e-6


def _qwen2_5_vl_encode():
    model = build_qwen2_5_vl(tiny_model_cfg(), ParallelConfig(), params_dtype=torch.float32, pre_process=True,
                             post_process=True, device="cpu").eval()
    return model.vision_model, lambda pixels, grid: model.projector(model.vision_model(pixels, grid))


def _qwen3_vl_encode():
    model = build_qwen3_vl(qwen3_vl_support.tiny_model_cfg(), ParallelConfig(), params_dtype=torch.float32,
                           pre_process=True, post_process=True, device="cpu",
                           vision=qwen3_vl_support.TINY_VISION).eval()
    return model.vision_model, model._encoder  # merged and DeepStack features


def test_frame_grids_give_every_frame_its_own_row():
    assert frame_grids(GRID_THW).tolist() == [[1, 8, 8], [1, 8, 12], [1, 8, 12], [1, 8, 12]]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_video_encoded_frame_by_frame_equals_it_encoded_whole(megatron_world_of_one, family):
    tower, encode = {"qwen2_5_vl": _qwen2_5_vl_encode, "qwen3_vl": _qwen3_vl_encode}[family]()
    patch_width = tower.patch_embed.proj.weight[0].numel()  # C * T * p * p
    pixels = torch.randn(int(GRID_THW.prod(-1).sum()), patch_width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = encode(pixels, GRID_THW)  # [P / m^2, width]
        by_frame = encode(pixels, frame_grids(GRID_THW))
    difference = (whole - by_frame).abs().max().item()
    print(f"{family}: frame by frame vs whole, max |difference| {difference:.2e} of max |feature| "
          f"{whole.abs().max().item():.2e}")
    assert whole.shape == by_frame.shape and difference <= TOLERANCE
