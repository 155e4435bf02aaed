"""HF weights straight into a built model, and a finished run's checkpoint out as HF.

``loongforge train checkpoint.load_hf=DIR`` and ``checkpoint.save_hf=true`` use these; they share the
mapping table and the readers/writers of ``loongforge convert``, so training from HF weights needs
no separate conversion step.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Optional

import torch

from loongforge.config.errors import InputError
from loongforge.convert.engine import (
    ConversionReport,
    Link,
    build_links,
    check_hf_tensors,
    family_of,
    mcore_to_hf,
    megatron_shapes,
    resolve_checkpoint_keys,
    resolve_mcore_checkpoint,
    to_hf,
    vocab_rows_at,
)
from loongforge.convert.hf_io import HFCheckpoint, is_hf_folder
from loongforge.convert.mcore_io import MODEL_DIR, McoreReader
from loongforge.models.hf.rules import VISION
from loongforge.models.hf.weights import expert_layers, expert_placement, vision_tp_group
from loongforge.models.registry import get_family
from loongforge.models.hf.state_dict_names import is_adapter_key


def _stage_links(model_cfg, layer_offset: int, expert_offset: int = 0) -> dict[str, Link]:
    """This pipeline stage's model state-dict key -> link (language layers renumbered locally, and
    experts: this expert-parallel rank's start at global index ``expert_offset``; the keys of experts
    other ranks hold are never looked up).

    A tied model's last stage (PP > 1) keeps its own copy of the embedding as the output layer:
    it is filled from ``model.embed_tokens.weight``. A link whose HF tensor holds every expert of a
    layer (``Rule.fuses_experts``) stands for each of those experts, one key each.
    """
    untied = dataclasses.replace(model_cfg, language=dataclasses.replace(model_cfg.language, tie_word_embeddings=False))
    by_key = {}
    for link in build_links(untied):
        if link.rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            link = dataclasses.replace(link, hf_keys=(link.rule.fallback_hf,))
        stacked_experts = link.expert is not None or link.rule.fuses_experts
        if link.layer is None and link.block is None and not stacked_experts:
            by_key[link.mcore_key] = link
            continue
        if link.block is not None:  # a hybrid decoder's layer, keyed by its global index
            key = link.mcore_key.replace(f"layers.{link.block}.", f"layers.{link.block - layer_offset}.", 1)
        elif link.layer is not None:
            key = link.mcore_key.replace("layers.", f"layers.{link.layer - layer_offset}.", 1)
        else:  # experts of a layer outside the decoder's stack (multi-token prediction's)
            key = link.mcore_key
        if link.rule.fuses_experts:
            for expert in range(expert_offset, model_cfg.language.moe.num_experts):
                by_key[key.replace(".experts.experts.", f".experts.local_experts.{expert - expert_offset}.", 1)] = (
                    dataclasses.replace(link, expert=expert))
            continue
        if link.expert is not None:
            if link.expert < expert_offset:
                continue
            key = key.replace(".experts.experts.", f".experts.local_experts.{link.expert - expert_offset}.", 1)
        by_key[key] = link
    return by_key


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path) -> int:
    """Copy this rank's shards of an HF checkpoint into ``model`` (a ``Qwen2_5_VLModel`` stage),
    one tensor at a time. Returns the number of tensors loaded."""
    model = getattr(model, "module", model)  # DDP wrapper
    checkpoint = HFCheckpoint(Path(hf_dir))
    check_hf_tensors(checkpoint, model.model_cfg, "the run's model config")
    language = model.language_model
    tp = language.pg_collection.tp
    vision_tp = vision_tp_group(model)
    layers = language.decoder.layers
    experts = expert_placement(expert_layers(language))
    links = _stage_links(model.model_cfg, layers[0].layer_number - 1 if len(layers) else 0,
                         expert_offset=0 if experts is None else experts.offset)

    def shard_of(link: Link) -> tuple[int, int]:
        if link.rule.group == VISION:
            return vision_tp.rank(), vision_tp.size()
        if link.expert is not None:
            return experts.tp_rank, experts.tp_size
        return tp.rank(), tp.size()

    # The experts of a layer come one by one from its fused tensors (gate_up, down), when a
    # family has them: keep the last two read instead of reading them again for every expert.
    load = functools.lru_cache(maxsize=2)(checkpoint.load)
    return _fill_from_hub(model, links, load, shard_of, where=str(hf_dir), holder="model")


@torch.no_grad()
def load_encoder_weights(encoder: torch.nn.Module, model_cfg, source: str | Path) -> int:
    """Fill a whole vision encoder (``ModelFamily.build_encoder``: vision TP 1) from an HF folder or
    a loongforge checkpoint (a ``step_*`` folder, or a checkpoint root: its latest). Both go
    through the HF tensors, so one table maps them. Returns the number of tensors loaded."""
    hub_tensor = _encoder_hub_tensors(model_cfg, Path(source))
    links = {key: link for key, link in _stage_links(model_cfg, 0).items() if link.rule.group == VISION}
    return _fill_from_hub(encoder, links, hub_tensor, lambda link: (0, 1), where=str(source), holder="encoder")


def _fill_from_hub(module: torch.nn.Module, links: dict[str, Link], hub_tensor, shard_of, *, where: str,
                   holder: str) -> int:
    """Copy into every tensor of ``module``'s state dict its shard of the HF tensors its link names.
    ``hub_tensor``: HF key -> tensor; ``shard_of``: link -> (rank, size) of the group sharding it."""
    loaded = 0
    for key, target in module.state_dict(keep_vars=True).items():
        if key.endswith("_extra_state") or is_adapter_key(key):  # LoRA adapters are not in an HF folder
            continue
        link = links.get(key)
        if link is None:
            raise InputError(f"{where}: no HF tensor maps to {holder} parameter {key}")
        hf = [hub_tensor(k) for k in link.hf_keys]
        if link.rule.fuses_experts:
            local = link.rule.transform.shard_expert(hf, link.expert, *shard_of(link))
        else:
            local = link.rule.transform.shard(hf, *shard_of(link))
        if local.shape != target.shape:
            raise InputError(f"{where}: {link.hf_keys[0]} gives {list(local.shape)} for {key}, "
                             f"the {holder} holds {list(target.shape)}")
        target.copy_(local)
        loaded += 1
    return loaded


def build_loaded_encoder(model_cfg, *, init_seed: int, device: torch.device | str,
                         weights: Optional[str | Path] = None,
                         group: Optional[torch.distributed.ProcessGroup] = None) -> torch.nn.Module:
    """A run's vision encoder in fp32 on ``device`` (the process's device: a CPU build installs the
    CPU patches), in eval mode: ``weights`` (HF folder or loongforge checkpoint) when given, else
    the initial weights training draws for ``init_seed``. ``group``: see ``ModelFamily.build_encoder``."""
    encoder = get_family(model_cfg.family).build_encoder(model_cfg, params_dtype=torch.float32, device=device,
                                                        init_seed=init_seed, group=group)
    if weights is not None:
        load_encoder_weights(encoder, model_cfg, weights)
    return encoder.eval()


def _encoder_hub_tensors(model_cfg, source: Path):
    """HF key -> tensor for the vision tower and merger of ``source`` (HF or loongforge)."""
    if is_hf_folder(source):
        checkpoint = HFCheckpoint(source)
        check_hf_tensors(checkpoint, model_cfg, "the run's model config")
        return checkpoint.load
    step_dir = resolve_mcore_checkpoint(source)
    reader = McoreReader(step_dir / MODEL_DIR)
    links = [link for link in build_links(model_cfg) if link.rule.group == VISION]
    shapes = megatron_shapes(links, family_of(model_cfg).hf_shapes(model_cfg), model_cfg, vocab_rows_at(model_cfg, 1))
    keys = resolve_checkpoint_keys(reader, links, shapes, model_cfg.language.vocab_size)
    tensors = {}
    for link in links:
        tensors.update(zip(link.hf_keys, to_hf(link, reader.read(keys[link.mcore_key], link.layer, link.expert))))
    return tensors.__getitem__


def export_hf(model_cfg, data_cfg, step_dir: str | Path, dst: str | Path, *, hf_source: Optional[str] = None,
              progress: bool = False) -> ConversionReport:
    """Write ``dst`` (replaced if present) as an HF folder ready to serve from a ``loongforge train``
    checkpoint: weights, config, and the tokenizer, processor and generation files of ``hf_source``
    or, where it has none, of the run's settings (``data_cfg``)."""
    return mcore_to_hf(Path(step_dir), Path(dst), model_cfg=model_cfg, data_cfg=data_cfg,
                       hf_source=Path(hf_source) if hf_source else None, overwrite=True, progress=progress)
