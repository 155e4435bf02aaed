"""Initial weights keyed by (seed, what they are): one seed gives one full model at every layout.

With CPU initialisation megatron-core draws each TP-sharded weight whole from torch's CPU generator
and keeps this rank's slice, so the TP layout never changed the model. The PP layout did: every
stage drew its own layers, in order, from the same seeded stream, so stage 1's first layer got the
numbers that PP=1 gave layer 0. Here each part that draws random numbers starts from a generator
seeded by ``keyed_seed(seed, key)``, where the key is a layout-independent name:

- ``vision_model``, ``projector``: the towers (always whole on the first stage);
- ``language_model.decoder.layers.<i>``: decoder layer ``i`` (0-based, global over all stages and
  virtual stages), see ``SeededTransformerLayer``;
- ``language_model.embedding``: the word embeddings (the first draw of ``GPTModel``);
- ``language_model.output_layer``: an untied output layer, redrawn by ``redraw_sharded`` after
  ``GPTModel`` built it (its first draw followed the embedding's on a first-and-last stage only);
- ``<layer key>.mlp.experts.<e>``: expert ``e`` (global index) of a mixture-of-experts layer, so an
  expert gets the same weights on whichever expert-parallel rank holds it (``SeededSequentialMLP``).

Each keyed draw runs in ``torch.random.fork_rng``, so it leaves the caller's stream as it found it.
On CUDA without ``use_cpu_initialization`` megatron-core draws each shard on the device from its RNG
tracker instead, and none of this applies (megatron's GPU initialisation depends on the TP layout).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Callable, Iterator, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank


def keyed_seed(seed: int, key: str) -> int:
    """A 63-bit seed from (seed, key), the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(f"loongforge-init:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# The (seed, key) of the innermost ``seeded`` block, for parts drawn under a key of their own.
_ACTIVE_KEY: contextvars.ContextVar[Optional[tuple[int, str]]] = contextvars.ContextVar("init_key", default=None)


@contextlib.contextmanager
def seeded(seed: Optional[int], key: str) -> Iterator[None]:
    """Inside: torch's CPU generator starts from ``keyed_seed(seed, key)``; afterwards it is back
    where it was. ``seed=None`` does nothing (the stream runs on, megatron's behaviour)."""
    if seed is None:
        yield
        return
    token = _ACTIVE_KEY.set((seed, key))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(keyed_seed(seed, key))
            yield
    finally:
        _ACTIVE_KEY.reset(token)


def seeded_below(suffix: str) -> contextlib.AbstractContextManager:
    """``seeded`` under ``<active key>.<suffix>`` inside a seeded block; nothing outside one."""
    active = _ACTIVE_KEY.get()
    return contextlib.nullcontext() if active is None else seeded(active[0], f"{active[1]}.{suffix}")


def draws_on_cpu(config: TransformerConfig) -> bool:
    """Whether megatron-core initialises this config's weights from torch's CPU generator."""
    return config.perform_initialization and config.use_cpu_initialization


class SeededTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose weights are drawn from (``init_seed``, its global layer index).

    ``init_key`` names the stack (``language_model.decoder.layers``); the global index counts the
    layers of earlier pipeline (and virtual pipeline) stages, as megatron-core numbers them.
    """

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 vp_stage: Optional[int] = None, *, init_seed: Optional[int], init_key: str):
        pp_group = (pg_collection or ProcessGroupCollection.use_mpu_process_groups()).pp
        # layer_number is 1-based within this stage; the key uses the 0-based global index.
        index = layer_number - 1 + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pp_group))
        with seeded(init_seed, f"{init_key}.{index}"):
            super().__init__(config, submodules, layer_number, hidden_dropout,
                             pg_collection=pg_collection, vp_stage=vp_stage)


def redraw_sharded(weight: torch.Tensor, full_shape: tuple[int, int], init_method: Callable,
                   *, seed: int, key: str, tp_rank: int, tp_size: int) -> None:
    """Draw the full ``full_shape`` weight with ``init_method`` from (seed, key) and copy this TP
    rank's row block into ``weight`` (a column-parallel shard), as megatron's CPU init slices it."""
    with seeded(seed, key):
        full = torch.empty(full_shape, dtype=torch.float32)
        init_method(full)
    rows = full_shape[0] // tp_size
    if weight.shape != (rows, full_shape[1]):
        raise ValueError(f"{key}: shard shape {tuple(weight.shape)} is not 1/{tp_size} of the rows of "
                         f"{full_shape}")
    with torch.no_grad():
        weight.copy_(full[tp_rank * rows:(tp_rank + 1) * rows].to(weight.dtype))


class SeededSequentialMLP(SequentialMLP):
    """megatron-core's ``SequentialMLP`` whose experts each draw their weights from their global
    index (``mlp.experts.<e>`` below the layer's key): with expert parallelism rank r holds experts
    r * n .. r * n + n - 1, which a plain ``SequentialMLP`` would draw as the stream's first n."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(0, config, submodules, pg_collection=pg_collection)  # the experts follow
        self.num_local_experts = num_local_experts
        first = self.ep_group.rank() * num_local_experts
        for local in range(num_local_experts):
            with seeded_below(f"mlp.experts.{first + local}"):
                self.local_experts.append(MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                                              is_expert=True, tp_group=self.tp_group))

