"""A digest of a module's weights: which encoder produced a folder of stored embeddings.

``loongforge encode`` records it in ``encoder.json``; training from those embeddings compares it
with its own encoder's, so features of other weights are never trained on silently.
"""

from __future__ import annotations

import hashlib

import torch


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over every tensor of ``module.state_dict()`` in name order: its name, shape and
    values as float32 (the same weights give the same digest whether held in bf16 or fp32, as long
    as the values are equal). megatron's ``_extra_state`` entries are not weights and are skipped."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(f"{name}:{list(values.shape)}\n".encode())
        digest.update(values.numpy().tobytes())
    return "sha256:" + digest.hexdigest()
