"""Pixel operations every image processor here shares, in transformers' exact numpy path so that
results are bit-equal to its processors: a bicubic PIL resize of the uint8 image, then a rescale in
float64 and a normalisation in float32. Torch-free."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from PIL import Image


def resize_bicubic(image: Image.Image, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3]; always through PIL.resize, as transformers does even at equal size."""
    return np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))


def normalize(pixels_uint8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [H, W, 3]: rescale by 1/255 in float64, then normalise in float32."""
    rescaled = (pixels_uint8.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (rescaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
