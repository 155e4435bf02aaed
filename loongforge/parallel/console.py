"""What a training process prints besides loongforge's own lines: known harmless third-party
warnings are filtered.

Each of these is expected in a supported setup and says nothing the run can act on: megatron-core
announcing the torch fallbacks it uses when Transformer Engine or Apex are absent (loongforge picks
its layers itself and prints them at start), and megatron's deprecation of a default it sets
itself. With ``logging.verbose=true`` (``--verbose``) they are shown, once each. Warnings of our
own and every other third-party warning always pass.
"""

from __future__ import annotations

import warnings

# (message start, the warning's category, the module that issues it), regexes as the warnings
# module matches them: the message from its start, the module in full.
KNOWN_HARMLESS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"Transformer Engine and Apex are not installed\. Falling back to", UserWarning, r"megatron\..*"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\..*"),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning, r"megatron\..*"),
)


def filter_known_warnings(verbose: bool) -> None:
    """Install the filters in this process (before megatron-core is imported: some warn at import)."""
    action = "once" if verbose else "ignore"
    for message, category, module in KNOWN_HARMLESS:
        warnings.filterwarnings(action, message=message, category=category, module=module)

