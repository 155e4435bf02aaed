"""What a training process prints besides loongforge's own lines: known harmless third-party
warnings are filtered.

Each of these is expected in a supported setup and says nothing the run can act on: megatron-core
announcing the torch fallbacks it uses when Transformer Engine or Apex are absent (loongforge picks
its layers itself and prints them at start), megatron's deprecation of a default it sets itself,
the optimizer's probe of `.grad` on its main parameters, and torch's deprecation of collectives
and checkpoint calls megatron makes. With ``logging.verbose=true`` (``--verbose``) they are shown, once each. Warnings of our
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
    # megatron-core 0.16's optimizer probes `.grad` of its fp32 main parameters, views that are not
    # autograd leaves; the gradients it uses are in `main_grad`.
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
     r"megatron\.core\.optimizer\..*"),
    # torch 2.13 renamed the tensor collectives (all_gather_into_tensor, reduce_scatter_tensor);
    # megatron-core 0.16 calls the old names, which torch's c10d logger wrapper reports.
    (r"`torch\.distributed\.\w+` is deprecated", FutureWarning, r"torch\.distributed\..*"),
    # Loading a checkpoint (--resume, checkpoint.load=): megatron-core 0.16's torch_dist strategy
    # calls torch.distributed.checkpoint's deprecated load_state_dict and hands it ShardedTensors,
    # which torch 2.13's planner reports twice.
    (r"`load_state_dict` is deprecated and will be removed", FutureWarning,
     r"megatron\.core\.dist_checkpointing\..*"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint\..*"),
)


def filter_known_warnings(verbose: bool) -> None:
    """Install the filters in this process (before megatron-core is imported: some warn at import)."""
    action = "once" if verbose else "ignore"
    for message, category, module in KNOWN_HARMLESS:
        warnings.filterwarnings(action, message=message, category=category, module=module)

