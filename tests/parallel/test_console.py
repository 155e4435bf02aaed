"""The console filter: megatron's fallback notices are hidden on a CPU run and shown on a CUDA run;
torch's deprecation of collectives is hidden where megatron-core calls them, shown where we do."""

from __future__ import annotations

import warnings

import pytest

from loongforge.parallel.console import filter_known_warnings

TE_NOTICE = ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning,
             "megatron.core.optimizer")
DEPRECATED = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `all_gather_single`."


def _shown(issue, *, verbose: bool = False, on_cuda: bool = False) -> list[str]:
    """The messages that reach the console when ``issue()`` warns, under the run's filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        filter_known_warnings(verbose, on_cuda=on_cuda)
        issue()
    return [str(w.message) for w in caught]


def _megatron_notice():
    message, category, module = TE_NOTICE
    warnings.warn_explicit(message, category, "megatron/core/optimizer/__init__.py", 24, module=module)


def _called_from(caller: str):
    """A deprecated collective as torch wraps it (the deprecation decorator in a torch module,
    torch's c10d logger wrapper around it), called by a function of module ``caller``."""
    torch_side = {"__name__": "torch.distributed.distributed_c10d", "warnings": warnings, "DEPRECATED": DEPRECATED}
    exec("def deprecated():\n    warnings.warn(DEPRECATED, FutureWarning, stacklevel=2)\n", torch_side)
    logger_side = {"__name__": "torch.distributed.c10d_logger", "inner": torch_side["deprecated"]}
    exec("def wrapper():\n    return inner()\n", logger_side)
    caller_side = {"__name__": caller, "collective": logger_side["wrapper"]}
    exec("def call():\n    collective()\n", caller_side)
    return caller_side["call"]


@pytest.mark.parametrize("on_cuda, shown", [(False, []), (True, [TE_NOTICE[0]])])
def test_megatrons_fallback_notices_show_on_a_cuda_run_only(on_cuda, shown):
    assert _shown(_megatron_notice, on_cuda=on_cuda) == shown


def test_a_deprecated_collective_is_hidden_where_megatron_calls_it_and_shown_where_we_do():
    assert _shown(_called_from("megatron.core.tensor_parallel.mappings")) == []
    assert _shown(_called_from("loongforge.parallel.encoder_dp")) == [DEPRECATED]
    assert _shown(_called_from("megatron.core.tensor_parallel.mappings"), verbose=True) == [DEPRECATED]
