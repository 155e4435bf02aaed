"""This process's peak memory so far, in MiB: what a rank needs of its host or device.

On CPU the resident-set high-water mark (``getrusage``'s ``ru_maxrss``: weights, gradients,
optimizer state, activations, and the Python and torch runtime itself); on CUDA the caching
allocator's peak allocation (tensors only, as ``bench model`` reports it).
"""

from __future__ import annotations

import resource
import sys

import torch

# ru_maxrss is in KiB on Linux and in bytes on macOS.
_RU_MAXRSS_PER_MIB = 2**20 if sys.platform == "darwin" else 2**10


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / _RU_MAXRSS_PER_MIB
