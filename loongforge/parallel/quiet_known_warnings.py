"""Imported for its effect: this process ignores the known harmless third-party warnings
(``console.KNOWN_HARMLESS``).

A fork server's preload takes module names, not calls: a launcher puts this module first in the
preload of a run without ``logging.verbose``, so that the server ignores the warnings megatron-core
issues while it is imported (once for every worker it then forks) as each worker would have. A
machine with a CUDA device counts as a CUDA run here (megatron's fallback notices show): the
server's preload cannot see the run's ``training.device``; each worker installs its run's filters.
"""

import torch

from loongforge.parallel.console import filter_known_warnings

filter_known_warnings(verbose=False, on_cuda=torch.cuda.is_available())
