"""``training.compile``'s parts (``models.layers.compiled``) compute what eager computes: each compiled function's
output and input gradients, in fp32, equal the eager original's in fp64 (<= 1e-6 of the tensor's largest
magnitude), and its time against eager is printed at a short and a long packed row (``bench.compile_parts``; the
CPU figures of docs/benchmarks/compile.md come from ``pytest tests/models/test_compiled.py -s``)."""

from __future__ import annotations

import pytest
import torch

from loongforge.bench.compile_parts import CASES, line, measure
from loongforge.models.layers import compiled, layer_backend
from loongforge.models.layers.compiled import PARTS, compile_parts
from loongforge.parallel import mcore_patches

BOUND = 1e-6
# A weight's gradient sums over the tokens, which inductor's fp32 reduction orders otherwise: measured 1.4e-6 of
# the largest (the norm's weight at 1,024 tokens; eager 1.2e-7).
SUMMED_BOUND = 5e-6
EAGER_RMS_NORM = layer_backend.rms_norm
SHAPES = (64, 1024)  # tokens: a short and a long packed row (dynamic shapes: one graph for both)


def test_auto_compiles_on_cuda_only():
    assert compile_parts("auto", torch.device("cpu")) == ()
    assert compile_parts("auto", torch.device("cuda")) == PARTS
    assert compile_parts("on", torch.device("cpu")) == PARTS and compile_parts("off", torch.device("cuda")) == ()


@pytest.mark.parametrize("part", CASES)
def test_compiled_part_equals_eager_forward_and_gradient(part):
    results = [measure(part, tokens) for tokens in SHAPES]
    print("\n" + "\n".join(line(result) for result in results))
    print(f"{part}: asserted {BOUND:.0e}, summed weight gradients {SUMMED_BOUND:.0e}")
    assert all(r["worst"] <= BOUND and r["worst_summed"] <= SUMMED_BOUND for r in results)


def test_apply_installs_exactly_the_parts_asked_for():
    try:
        assert compiled.apply(("norm", "rope")) == ["compile_rms_norm", "compile_rope"]
        assert layer_backend.rms_norm is not EAGER_RMS_NORM
        assert compiled.apply(("rope",)) == [] and layer_backend.rms_norm is EAGER_RMS_NORM
        assert "compile_rope" in mcore_patches.applied()
    finally:
        compiled.apply(())
    assert not [name for name in mcore_patches.applied() if name.startswith("compile_")]
