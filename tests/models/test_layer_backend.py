"""Layer backends: what ``auto`` picks per device, dtype and installed package; impossible explicit
choices are config errors naming the key; the local fused norm-linear equals norm then linear."""

import sys

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend

from loongforge.config.errors import ConfigError
from loongforge.models.layers import layer_backend
from loongforge.models.layers.attention import (
    FlashCoreAttention,
    SDPACoreAttention,
    VarlenCoreAttention,
    sdpa_backends,
)
from loongforge.models.layers.layer_backend import (
    RMSNorm,
    RMSNormColumnParallelLinear,
    block_modules,
    passed_over_backends,
    resolve_layer_backend,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
VARLEN = "torch.nn.attention.varlen"  # torch >= 2.10


@pytest.fixture
def installed(monkeypatch):
    """Pretend a set of optional packages is importable."""
    def pretend(*packages):
        monkeypatch.setattr(layer_backend, "_import_problem",
                            lambda name: None if name in packages else "not installed")
    return pretend


@pytest.mark.parametrize("packages, device, dtype, expected", [
    ((), CPU, torch.float32, "sdpa"),
    (("transformer_engine", "flash_attn"), CPU, torch.bfloat16, "sdpa"),  # CPU: never a GPU kernel
    (("transformer_engine", "flash_attn"), CUDA, torch.bfloat16, "te"),
    (("flash_attn",), CUDA, torch.bfloat16, "flash"),
    (("flash_attn",), CUDA, torch.float32, "sdpa"),  # flash-attn cannot run fp32
    ((), CUDA, torch.bfloat16, "sdpa"),
    # torch's varlen kernel where flash-attn does not import; fp32 or CPU: SDPA per segment
    (("flash_attn", VARLEN), CUDA, torch.bfloat16, "flash"),
    ((VARLEN,), CUDA, torch.bfloat16, "varlen"),
    ((VARLEN,), CUDA, torch.float32, "sdpa"),
    ((VARLEN,), CPU, torch.bfloat16, "sdpa"),
])
def test_auto_picks_the_first_backend_that_can_run(installed, packages, device, dtype, expected):
    installed(*packages)
    assert resolve_layer_backend("auto", device, dtype) == expected


@pytest.mark.parametrize("requested, packages, device, dtype, reason", [
    ("te", ("transformer_engine",), CPU, torch.float32, "needs a CUDA device"),
    ("flash", ("flash_attn",), CPU, torch.bfloat16, "needs a CUDA device"),
    ("te", (), CUDA, torch.bfloat16, "needs the transformer_engine package"),
    ("flash", (), CUDA, torch.bfloat16, "needs the flash_attn package"),
    ("flash", ("flash_attn",), CUDA, torch.float32, "needs fp16 or bf16 weights, not float32"),
    ("varlen", (), CUDA, torch.bfloat16, r"needs the torch.nn.attention.varlen package \(torch >= 2.10\)"),
    ("varlen", (VARLEN,), CUDA, torch.float32, "needs fp16 or bf16 weights, not float32"),
])
def test_an_impossible_explicit_choice_names_the_key(installed, requested, packages, device, dtype, reason):
    installed(*packages)
    with pytest.raises(ConfigError, match=rf"model.layer_backend='{requested}' {reason}.*use sdpa or auto"):
        resolve_layer_backend(requested, device, dtype)


@pytest.fixture
def broken_transformer_engine(tmp_path, monkeypatch):
    """A transformer_engine whose import fails as a CUDA-mismatched build does, and a flash_attn
    that imports, on the path; both gone from sys.modules afterwards."""
    (tmp_path / "transformer_engine").mkdir()
    (tmp_path / "transformer_engine" / "__init__.py").write_text(
        'raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")\n')
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("transformer_engine", "flash_attn"):
        sys.modules.pop(name, None)


def test_auto_passes_over_an_installed_but_broken_package_and_says_why(broken_transformer_engine):
    assert resolve_layer_backend("auto", CUDA, torch.bfloat16) == "flash"
    lines = passed_over_backends("auto", CUDA, torch.bfloat16)
    print(lines)
    assert lines == ["model.layer_backend=auto: te needs the transformer_engine package, which is installed but "
                     "does not import (OSError: libcudart.so.12: cannot open shared object file: No such file or "
                     "directory); using flash"]
    assert passed_over_backends("auto", CPU, torch.bfloat16) == []  # CPU: no GPU package is even tried
    with pytest.raises(ConfigError, match=r"model.layer_backend='te' needs the transformer_engine package, which "
                                          r"is installed but does not import \(OSError: libcudart"):
        resolve_layer_backend("te", CUDA, torch.bfloat16)


def test_auto_says_nothing_of_packages_that_are_not_installed(installed):
    installed()
    assert passed_over_backends("auto", CUDA, torch.bfloat16) == []


def test_unknown_backend_names_the_key():
    with pytest.raises(ConfigError, match=r"model.layer_backend='xformers' is not one of auto, te, flash, varlen, sdpa"):
        resolve_layer_backend("xformers", CPU, torch.float32)


def test_local_backends_share_the_fused_norm_layout():
    for name, attention in (("sdpa", SDPACoreAttention), ("flash", FlashCoreAttention),
                            ("varlen", VarlenCoreAttention)):
        modules = block_modules(name)
        assert modules.core_attention is attention
        assert modules.norm_column_linear is RMSNormColumnParallelLinear
        assert modules.column_linear is ColumnParallelLinear
        assert name in modules.describe()


def test_fused_norm_linear_equals_norm_then_linear(megatron_world_of_one):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, layernorm_epsilon=1e-6,
                               use_cpu_initialization=True)
    fused = RMSNormColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_, bias=True,
                                        gather_output=False)
    assert {"weight", "bias", "layer_norm_weight"} <= set(fused.state_dict())
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        fused.bias.uniform_(-1, 1)
    norm = RMSNorm(config, 16, eps=1e-6)
    norm.weight.data.copy_(fused.layer_norm_weight.data)
    x = torch.randn(5, 1, 16)  # [s, b, h]
    out, _ = fused(x)
    expected = torch.nn.functional.linear(norm(x), fused.weight, fused.bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_sdpa_on_cuda_never_picks_cudnn():
    # cuDNN's attention plans every new shape (~84 ms on the H200, flash 0.5 ms): packed rows make new
    # shapes every step (docs/benchmarks/gpu.md). On the CPU torch chooses as it likes.
    cuda = sdpa_backends(torch.device("cuda"))
    print("SDPA kernels allowed on CUDA:", cuda)
    assert SDPBackend.CUDNN_ATTENTION not in cuda
    assert cuda[0] == SDPBackend.FLASH_ATTENTION and SDPBackend.MATH in cuda
    assert sdpa_backends(torch.device("cpu")) is None


def test_models_without_linear_attention_never_resolve_its_kernel():
    # fla's import costs ~12 s of a CUDA process's start; only hybrid models pick a gated delta rule.
    plain = block_modules("sdpa", CUDA)
    assert plain.linear_attention is None and "gated delta rule" not in plain.describe()
    hybrid = block_modules("sdpa", CPU, linear_attention_layers=True)
    assert hybrid.linear_attention is not None and "gated delta rule: torch" in hybrid.describe()
