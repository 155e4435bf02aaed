"""Set-up shared by every test module."""

# Before any test module is imported (several import megatron-core before loongforge): loongforge's
# import installs the deferred megatron jit (parallel/mcore_jit.py), as in every loongforge process.
import loongforge  # noqa: F401
from loongforge.parallel import fork_server


def pytest_sessionfinish(session, exitstatus):
    # The fork server of tests.models.helpers.run_workers, ended and reaped by the session (it would
    # otherwise exit only once it noticed the session's end).
    fork_server.stop()
