"""Set-up shared by every test module."""

import os

# The suite is CPU-only, its figures measured there. On a GPU machine `training.device=auto` (the default)
# and `bench --device auto` would move the tests' runs onto the GPU (several ranks' NCCL on one device,
# other kernels than the bounds were set for): the first GPU check failed so (docs/benchmarks/gpu.md).
# Hidden before torch initialises CUDA, from the tests and from every process they start.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Before any test module is imported (several import megatron-core before loongforge): loongforge's
# import installs the deferred megatron jit (parallel/mcore_jit.py), as in every loongforge process.
import loongforge  # noqa: F401
from loongforge.parallel import fork_server


def pytest_sessionfinish(session, exitstatus):
    # The fork server of tests.models.helpers.run_workers, ended and reaped by the session (it would
    # otherwise exit only once it noticed the session's end).
    fork_server.stop()
