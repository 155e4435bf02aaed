"""megatron-core ``dist_checkpointing`` (torch_dist) folders, read and written region by region.

What ``loongforge train`` writes under ``step_*/model_optim/`` is a torch.distributed.checkpoint
(DCP) folder whose tensors have TP- and PP-independent *global* shapes: language-layer tensors are
stacked along a leading layer axis (``language_model.decoder.layers.<name>`` of shape [L, ...]),
everything else is the whole TP=1 tensor. One global layout therefore serves every TP/PP, and
dist_checkpointing reshards on load.

- ``McoreReader.read(key, layer)`` loads one tensor, or one layer's slice of a stacked tensor,
  through a DCP load plan covering just that region (whatever chunks the writing ranks produced).
- ``write_mcore(folder, items)`` saves with a DCP save plan whose write items are declared up front
  (name, dtype, global shape, chunk) and whose data is produced lazily in ``resolve_data``: one
  chunk (one tensor or one layer) is in memory at a time.

``_extra_state`` objects (megatron's FP8 metadata, empty without Transformer Engine) are not
weights: they are not read, and a converted checkpoint does not contain them (a model-only load
skips them, see ``loongforge.train.checkpoint``).
"""

from __future__ import annotations

import functools
import json
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from loongforge.config.errors import InputError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

MODEL_DIR = "model_optim"
# What megatron-core's dist_checkpointing.save writes beside the DCP files; its loader reads it.
DIST_CKPT_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                    "common_backend": "torch", "common_backend_version": 1}


def _dcp() -> types.ModuleType:
    """``torch.distributed.checkpoint``; its submodules (``metadata``, ``planner``, ...) come with it."""
    # lazy: DCP imports DTensor and its ops (~0.8 s a process), which a training rank needs only
    # when it reads or writes a checkpoint
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _on_dcp_base(methods: type, base: str) -> type:
    """The class ``methods`` over the DCP class at ``base`` (a dotted path under
    ``torch.distributed.checkpoint``), made on first use so that importing this module imports no DCP."""
    base_class = functools.reduce(getattr, base.split("."), _dcp())
    return type(methods.__name__, (methods, base_class), {"__module__": __name__, "__doc__": methods.__doc__})


@contextmanager
def _single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_mcore_folder(path: Path) -> bool:
    return (path / MODEL_DIR / ".metadata").is_file()


class _CachedReader:
    """DCP's FileSystemReader (``_on_dcp_base``) that parses ``.metadata`` once (it is read again by
    every load call)."""

    _metadata = None

    def read_metadata(self):
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _RegionLoadPlanner:
    """A DCP LoadPlanner (``_on_dcp_base``) for explicit regions: {key: (offsets, destination
    tensor)}; no process group."""

    def __init__(self, regions: dict[str, tuple[tuple[int, ...], torch.Tensor]]):
        self.regions = regions

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        dcp = _dcp()
        items: list[ReadItem] = []
        for key, (offsets, dest) in self.regions.items():
            chunk = dcp.metadata.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.size())
            items += dcp.planner_helpers.create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk])
        return dcp.planner.LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError(f"unexpected object {read_item.dest_index.fqn} in a tensor load plan")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.regions[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # the reader copied into the narrowed view of the destination


class McoreReader:
    """Tensors of a dist_checkpointing folder (``<step>/model_optim``), by global key and layer."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.storage = _on_dcp_base(_CachedReader, "FileSystemReader")(str(self.folder))
        try:
            metadata = self.storage.read_metadata()
        except Exception as exc:
            raise InputError(f"{self.folder}: unreadable dist_checkpointing metadata ({exc})") from None
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, _dcp().metadata.TensorStorageMetadata)
        }

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, layer: Optional[int] = None, expert: Optional[int] = None) -> torch.Tensor:
        """The whole tensor, or ``[layer]`` of a layer-stacked one (``[layer, expert]`` of a layer-
        and expert-stacked one)."""
        shape, stack = self.shape(key), stack_index(layer, expert)
        offsets = (*stack, *(0,) * (len(shape) - len(stack)))
        dest = torch.empty((1,) * len(stack) + shape[len(stack):], dtype=self.dtype(key))
        try:
            with _single_process():
                planner = _on_dcp_base(_RegionLoadPlanner, "LoadPlanner")({key: (offsets, dest)})
                _dcp().load({}, storage_reader=self.storage, planner=planner, no_dist=True)
        except Exception as exc:
            raise InputError(f"{self.folder}: cannot read tensor {key}"
                             f"{'' if layer is None else f' at {list(stack)}'}: {exc}") from None
        return unstacked(dest, stack)


def stack_index(layer: Optional[int], expert: Optional[int]) -> tuple[int, ...]:
    """Where a chunk sits on the stacked leading axes of its key: () for a whole tensor, (layer,) on
    megatron's layer axis, (layer, expert) on the layer and expert axes of a mixture-of-experts
    layer's experts (megatron-core's ``SequentialMLP`` stacks its experts after the layer axis), (expert,)
    for a hybrid decoder's layer, whose keys are its own."""
    return tuple(index for index in (layer, expert) if index is not None)


def stacked(tensor: torch.Tensor, stack: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` with a length-1 axis in front for each stacked axis."""
    return tensor.reshape((1,) * len(stack) + tuple(tensor.shape))


def unstacked(tensor: torch.Tensor, stack: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` without its length-1 stacked leading axes."""
    return tensor.reshape(tuple(tensor.shape[len(stack):]))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McoreItem:
    """One chunk of the checkpoint: global ``key`` of ``global_shape``, and either the whole tensor
    (``layer`` None) or the ``[layer]`` slice of a layer-stacked one (``[layer, expert]`` of a
    layer- and expert-stacked one: a mixture-of-experts layer's experts), produced by ``produce``.

    ``region`` (offsets, sizes in the global tensor, layer axis included) makes the chunk one
    rank's shard instead, as the ranks of a TP layout write it (``convert --roundtrip``)."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    layer: Optional[int]
    produce: Callable[[], torch.Tensor]
    region: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None
    expert: Optional[int] = None

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        if self.region is not None:
            return tuple(self.region[1])
        stack = stack_index(self.layer, self.expert)
        return (1,) * len(stack) + self.global_shape[len(stack):]

    @property
    def offsets(self) -> tuple[int, ...]:
        if self.region is not None:
            return tuple(self.region[0])
        stack = stack_index(self.layer, self.expert)
        return (*stack, *(0,) * (len(self.global_shape) - len(stack)))


class _LazySavePlanner:
    """A save plan declared from ``McoreItem``s; each chunk's data is made when the writer asks
    (over DCP's DefaultSavePlanner, ``_on_dcp_base``).

    torch's FileSystemWriter keeps a reference to every tensor it wrote to a file (it collects them
    for its safetensors output format, unused here), which would hold the whole model by the end.
    So each chunk is handed over in storage of its own, and that storage is emptied when the writer
    asks for the next chunk: with the serial loader (``per_thread_copy_ahead=0``) the previous chunk
    has been written by then.
    """

    def __init__(self, items: list[McoreItem], on_written: Callable[[McoreItem, torch.Tensor], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items = {(i.key, i.offsets): i for i in items}
        self.on_written = on_written
        self.previous: Optional[torch.Tensor] = None

    def _release_previous(self) -> None:
        if self.previous is not None:
            self.previous.untyped_storage().resize_(0)
            self.previous = None

    def create_local_plan(self) -> SavePlan:
        metadata, planner = _dcp().metadata, _dcp().planner
        write_items = [
            planner.WriteItem(
                index=metadata.MetadataIndex(item.key, torch.Size(item.offsets)),
                type=planner.WriteItemType.SHARD,
                tensor_data=planner.TensorWriteData(
                    chunk=metadata.ChunkStorageMetadata(offsets=torch.Size(item.offsets),
                                                        sizes=torch.Size(item.chunk_shape)),
                    properties=metadata.TensorProperties(dtype=item.dtype),
                    size=torch.Size(item.global_shape),
                ),
            )
            for item in self.items.values()
        ]
        self.plan = planner.SavePlan(write_items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        self._release_previous()
        item = self.items[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = item.produce()
        if tensor.dtype != item.dtype or tuple(tensor.shape) != item.chunk_shape:
            raise RuntimeError(f"{item.key}: produced {tensor.dtype} {tuple(tensor.shape)}, planned "
                               f"{item.dtype} {item.chunk_shape}")
        self.on_written(item, tensor)
        tensor = tensor.contiguous()
        storage = tensor.untyped_storage()
        if not storage.resizable() or storage.nbytes() != tensor.nbytes:  # a view or a file mapping
            tensor = tensor.clone()
        self.previous = tensor
        return tensor


def write_mcore(folder: Path, items: list[McoreItem],
                on_written: Callable[[McoreItem, torch.Tensor], None] = lambda item, tensor: None) -> None:
    """A dist_checkpointing folder (``folder`` = ``<step>/model_optim``) holding ``items``.

    One writer thread and one file: the serial loader resolves and writes chunk after chunk.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # per_thread_copy_ahead=0: the serial loader (no prefetch, see _LazySavePlanner) even with CUDA
    writer = _dcp().FileSystemWriter(str(folder), single_file_per_rank=True, thread_count=1, sync_files=True,
                                     per_thread_copy_ahead=0)
    planner = _on_dcp_base(_LazySavePlanner, "default_planner.DefaultSavePlanner")(items, on_written)
    with _single_process():
        _dcp().save({}, storage_writer=writer, planner=planner, no_dist=True)
    planner._release_previous()
    torch.save({}, folder / "common.pt")  # dist_checkpointing's non-sharded part: nothing for a model
    (folder / "metadata.json").write_text(json.dumps(DIST_CKPT_CONFIG))

