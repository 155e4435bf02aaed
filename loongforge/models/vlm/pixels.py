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


def patch_rows(squares: np.ndarray, patch_size: int) -> np.ndarray:
    """[n, C, S, S] -> [n * (S//p)^2, C*p*p]: each square's whole patches row-major (a Conv2d with
    kernel = stride and valid padding leaves the last ``S % p`` pixels out), each flattened as the
    patch embedding's weight is ([C, p, p]): a square tower's pixel rows (grid (n, S//p, S//p))."""
    count, channels, side = squares.shape[0], squares.shape[1], squares.shape[-1] // patch_size
    whole = squares[..., :side * patch_size, :side * patch_size]
    grid = whole.reshape(count, channels, side, patch_size, side, patch_size).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(grid).reshape(count * side * side, channels * patch_size * patch_size)
