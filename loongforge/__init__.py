"""loongforge: load-balanced training of vision-language models on megatron-core."""

from loongforge.parallel import mcore_jit

__version__ = "0.1.0"

# Before any loongforge module imports megatron-core, in every process that imports loongforge (the
# CLI, its workers, tests): megatron's jit_fuser compiles on first call instead of importing
# torch._dynamo at import time (parallel/mcore_jit.py).
mcore_jit.install()
