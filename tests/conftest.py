"""Set-up shared by every test module."""

# Before any test module is imported (several import megatron-core before loongforge): loongforge's
# import installs the deferred megatron jit (parallel/mcore_jit.py), as in every loongforge process.
import loongforge  # noqa: F401
