"""FP8 GEMMs through ``torch._scaled_mm`` (``models.fp8``): each of a linear's three GEMMs equals the
same product of the quantised-then-dequantised operands (the scales and layouts are right) to fp32
rounding, and stays within FP8's own error of the full-precision product."""

from __future__ import annotations

import pytest
import torch

from loongforge.models.fp8 import E4M3, E5M2, Fp8Matmul, eligible, quantize


def _dequantized(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fp8, inverse = quantize(tensor, dtype)
    return fp8.float() * inverse


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def test_quantize_maps_the_absolute_maximum_to_the_largest_fp8_value():
    tensor = torch.tensor([[0.5, -3.0], [1.25, 0.0]])
    fp8, inverse = quantize(tensor, E4M3)
    assert float(fp8.float().abs().max()) == torch.finfo(E4M3).max == 448.0
    assert float(inverse) == pytest.approx(3.0 / 448.0)
    zeros, inverse = quantize(torch.zeros(2, 2), E5M2)
    assert float(inverse) == 1.0 and not zeros.float().any()


@pytest.mark.parametrize("tokens", [64, 37])  # 37: rows padded to the GEMM's multiple of 16
def test_three_gemms_are_the_products_of_the_quantised_operands(tokens):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 96, generator=generator, requires_grad=True)  # [M, K]
    weight = (0.05 * torch.randn(48, 96, generator=generator)).requires_grad_(True)  # [N, K]
    grad_out = torch.randn(tokens, 48, generator=generator)  # [M, N]
    y = Fp8Matmul.apply(x, weight)
    y.backward(grad_out)

    x_q, w_q, dy_q = _dequantized(x, E4M3), _dequantized(weight, E4M3), _dequantized(grad_out, E5M2)
    assert _relative(y, x_q @ w_q.t()) <= 1e-6
    assert _relative(x.grad, dy_q @ w_q) <= 1e-6
    assert _relative(weight.grad, dy_q.t() @ x_q) <= 1e-6
    # Against full precision: E4M3 keeps 3 mantissa bits, E5M2 2.
    assert _relative(y, x.detach() @ weight.detach().t()) <= 0.05
    assert _relative(x.grad, grad_out @ weight.detach()) <= 0.1
    assert _relative(weight.grad, grad_out.t() @ x.detach()) <= 0.1


def test_only_widths_of_sixteen_are_eligible():
    assert eligible(torch.empty(48, 96)) and not eligible(torch.empty(48, 100)) and not eligible(torch.empty(8, 96))
