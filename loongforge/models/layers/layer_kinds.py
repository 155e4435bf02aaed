"""A block linear's kind by its module name: the one naming FP8 (``models.layers.fp8``) and LoRA
(``models.layers.lora``) choose layers by.

A kind is ``<tower>.<linear>``: the tower is the top-level part of a family's model
(``vision_model``, ``projector``, ``language_model``), the linear the last part of the megatron name
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``; a Gated DeltaNet's ``in_proj`` and
``out_proj`` are ``qkv`` and ``proj``, multi-latent attention's query and latent projections ``qkv``); a routed expert's linears get
``expert_`` kinds (``language.expert_fc1``). Everything else (embeddings, the LM head, the router,
norms) has no kind.
"""

from __future__ import annotations

from typing import Optional

# A Gated DeltaNet layer's token mixer has an input projection (q, k, v, its gates) and an output
# projection: the same two roles as attention's qkv and proj, so the same kinds adapt them.
# Multi-latent attention's query and key/value projections (down to the latents, up to the heads, or the
# query's one projection) are its qkv.
LINEARS = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2",
           "in_proj": "qkv", "out_proj": "proj", "linear_q_proj": "qkv", "linear_q_down_proj": "qkv",
           "linear_q_up_proj": "qkv", "linear_kv_down_proj": "qkv", "linear_kv_up_proj": "qkv"}
TOWERS = {"vision_model": "vision", "projector": "projector", "language_model": "language"}


def layer_kind(name: str) -> Optional[str]:
    """``<tower>.<kind>`` of a linear by its module name (``language.qkv``, ``vision.fc2``,
    ``projector.fc1``, ``language.expert_fc1``); None for a module that is no block linear."""
    parts = name.split(".")
    tower = TOWERS.get(parts[0])
    kind = LINEARS.get(parts[-1])
    if tower is None or kind is None:
        return None
    return f"{tower}.{'expert_' if 'experts' in parts else ''}{kind}"
