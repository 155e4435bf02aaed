"""mcore_jit: megatron-core's jit_fuser compiles on first call, as torch.compile would, and importing
megatron-core after loongforge imports no torch._dynamo."""

import json
import subprocess
import sys

import megatron.core.jit
import torch
from megatron.core.fusions import fused_bias_geglu

from loongforge.parallel import mcore_jit


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_megatron_imported_after_loongforge_has_the_lazy_jit_fuser_and_no_dynamo():
    found = _run("import json, sys, loongforge, megatron.core.jit as jit\n"
                 "from megatron.core.fusions import fused_bias_geglu\n"
                 "print(json.dumps({'fuser': jit.jit_fuser.__name__, 'dynamo': 'torch._dynamo' in sys.modules,\n"
                 "                  'deferred': fused_bias_geglu.geglu.__code__.co_name}))")
    assert found == {"fuser": "lazy_compile", "dynamo": False, "deferred": "compile_on_first_call"}


def test_without_the_hook_megatron_imports_dynamo():
    """The premise: megatron-core alone imports torch._dynamo (if this fails, the hook can go)."""
    assert _run("import json, sys, megatron.core\nprint(json.dumps('torch._dynamo' in sys.modules))")


def test_this_process_has_it_too():
    """tests/conftest.py imports loongforge before any test module imports megatron-core."""
    assert mcore_jit.installed() and megatron.core.jit.jit_fuser is mcore_jit.lazy_compile
    assert fused_bias_geglu.geglu.__code__.co_name == "compile_on_first_call"
    assert fused_bias_geglu.geglu._torchdynamo_inline.__name__ == "geglu"


def test_torch_compile_runs_once_on_first_call_with_the_options(monkeypatch):
    calls = []

    def fake_compile(model, **options):
        calls.append((model, options))
        return lambda *args: ("compiled", model(*args))

    def double(x):
        return 2 * x

    monkeypatch.setattr(torch, "compile", fake_compile)
    deferred = mcore_jit.lazy_compile(double, dynamic=False)
    decorated = mcore_jit.lazy_compile(fullgraph=True)(double)
    assert calls == [] and deferred.__name__ == "double" and deferred._torchdynamo_inline is double
    assert deferred(3) == ("compiled", 6) and deferred(4) == ("compiled", 8)
    assert decorated(1) == ("compiled", 2)
    assert calls == [(double, {"dynamic": False}), (double, {"fullgraph": True})]


def test_the_first_call_compiles_with_dynamo():
    import torch._dynamo  # noqa: F401  (this test alone: the point of the hook is not importing it)

    frames = torch._dynamo.utils.counters["frames"]

    def scaled_add(x, y):
        return x * 2 + y

    before = frames["ok"]
    deferred = mcore_jit.lazy_compile(scaled_add, backend="eager")
    assert frames["ok"] == before
    x = torch.arange(4.0)
    assert torch.equal(deferred(x, x), x * 3) and frames["ok"] == before + 1
    assert torch.equal(deferred(x, x), x * 3) and frames["ok"] == before + 1  # cached, as torch.compile's
