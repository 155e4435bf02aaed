"""Exports of a LoRA run's checkpoint: the merged model and PEFT's adapter folder.

A checkpoint stores each adapter whole (``models.layers.lora``: A and B at their full shapes, B's rows laid
out as the fused weight's), whatever TP / PP / EP trained it, so both exports work from any layout:
- merged (``convert CKPT OUT --to hf``): every adapted weight becomes ``W + (alpha / r) B A`` before
  it is written, in megatron's whole-tensor layout (``lora_params.merged_weight``; a fused weight's
  rows take their own part's A), then mapped to HF names like any weight;
- adapter (``--adapter``): ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's
  module names for the HF model, megatron's fused q/k/v and gate/up adapters written as the separate
  adapters they equal (``lora_params.lora_rules``); ``peft.PeftModel.from_pretrained(base, OUT)`` loads it.
  Vision-tower and projector adapters are refused there (serving stacks load language adapters only:
  export the merged model), as are adapters of experts the HF model fuses into one tensor (no PEFT
  module to hold them).
The LoRA settings (rank, alpha, targets) and the base come from the checkpoint's meta.json
(``lora_base``: a LoRA checkpoint holds the adapters alone, the merged export reads the base's HF
folder, checked against the recorded digest) or else the run's config.yaml beside the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from loongforge.config.errors import InputError
from loongforge.config.loader import load_resolved_config
from loongforge.config.schema import LoraConfig, ModelConfig
from loongforge.convert.checkpoint_folders import LORA_BASE_KEY, META_FILE, weights_digest
from loongforge.models.layers.lora_params import is_column_rule, merged_weight, row_parts
from loongforge.models.registry import get_family
from loongforge.models.hf.state_dict_names import LORA_A, LORA_B, is_adapter_key

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's saved keys: the wrapper's path to the HF model
_WEIGHT = ".weight"


@dataclass(frozen=True)
class CheckpointLora:
    """A checkpoint's adapters: the run's LoRA settings and the base model it was trained on."""

    settings: LoraConfig
    base: Optional[str]  # the base's path (an HF folder or a loongforge step folder), where recorded
    random_base: bool = False  # trained on the seed's random initial weights, kept nowhere
    digest: Optional[str] = None  # the base's content digest (checkpoint_folders.weights_digest)

    @property
    def scaling(self) -> float:
        return self.settings.alpha / self.settings.rank


def has_adapters(checkpoint_keys) -> bool:
    return any(is_adapter_key(key) for key in checkpoint_keys if not key.startswith("optimizer."))


def checkpoint_lora(step_dir: Path, checkpoint_keys, run_config: Optional[Path]) -> Optional[CheckpointLora]:
    """The LoRA settings and base of a checkpoint that holds adapters (None: it holds none): its
    meta.json's record, else (checkpoints before the record) the run's config.yaml beside it."""
    if not has_adapters(checkpoint_keys):
        return None
    meta = step_dir / META_FILE
    recorded = json.loads(meta.read_text()).get(LORA_BASE_KEY) if meta.is_file() else None
    if recorded is not None:
        settings = LoraConfig(rank=int(recorded["rank"]), alpha=float(recorded["alpha"]),
                              dropout=float(recorded.get("dropout", 0.0)), targets=list(recorded["targets"]),
                              modules=list(recorded["modules"]), experts=bool(recorded.get("experts", False)))
        return CheckpointLora(settings, recorded.get("path"), recorded.get("kind") == "seed", recorded.get("digest"))
    if run_config is None:
        raise InputError(f"{step_dir}: holds LoRA adapters but no record of their settings (meta.json's "
                         f"{LORA_BASE_KEY}, or the run's config.yaml beside it); copy the run's config.yaml next "
                         f"to the checkpoints folder")
    cfg = load_resolved_config(run_config)
    return CheckpointLora(cfg.lora, cfg.checkpoint.load_hf or cfg.checkpoint.load, False)


def checked_base(lora: CheckpointLora, step_dir: Path) -> Path:
    """The base a checkpoint of adapters alone merges into: its recorded HF folder, with the same
    content; one line otherwise."""
    if lora.random_base or lora.base is None:
        raise InputError(f"{step_dir}: its adapters were trained on a random base (no checkpoint.load_hf), which no "
                         f"file holds: there is nothing to merge them into; export them with --adapter")
    base = Path(lora.base)
    if not base.is_dir():
        raise InputError(f"{step_dir}: its base {base} is gone; put the base model's HF folder back there")
    if lora.digest is not None and weights_digest(base) != lora.digest:
        raise InputError(f"{step_dir}: its base {base} no longer holds the weights the adapters were trained on "
                         f"(its content changed); put the original base model back there")
    return base


def adapter_key(weight_key: str, matrix: str) -> str:
    return weight_key[: -len(_WEIGHT)] + (LORA_A if matrix == "A" else LORA_B)


def merged_chunk(link, chunk: torch.Tensor, read: Callable[[str], Optional[torch.Tensor]], lora: CheckpointLora,
                 hf_shapes: dict) -> torch.Tensor:
    """``chunk`` (a link's whole megatron tensor, one layer's if stacked) with its adapter merged;
    unchanged where the checkpoint has no adapter for it. ``read(key)``: that link's slice of a
    checkpoint tensor, None where the checkpoint has no such key."""
    if not link.mcore_key.endswith(_WEIGHT):
        return chunk
    A, B = read(adapter_key(link.mcore_key, "A")), read(adapter_key(link.mcore_key, "B"))
    if A is None or B is None:
        return chunk
    parts = row_parts(link.rule, hf_shapes, 0, 1) if is_column_rule(link.rule) else None
    return merged_weight(chunk, A, B, parts, lora.scaling)


def refuse_unexportable(lora: CheckpointLora, model_cfg: ModelConfig, adapter_links: list, where: Path) -> None:
    """One line when the adapters cannot go into a PEFT folder that serves."""
    towers = [target for target in lora.settings.targets if target != "language"]
    if towers:
        raise InputError(f"{where}: holds {' and '.join(towers)} adapters, which serving stacks do not load as "
                         f"adapters (they take language-model LoRA only): export the merged model "
                         f"(convert --to hf without --adapter)")
    fused_experts = lora.settings.experts and not any("experts" in link.mcore_key for link in adapter_links)
    if fused_experts:
        raise InputError(f"{where}: holds routed experts' adapters, and {model_cfg.family}'s HF model keeps each "
                         f"layer's experts in one tensor with no PEFT module per expert: export the merged model "
                         f"(convert --to hf without --adapter)")


def adapter_config(lora: CheckpointLora, module_names: list[str]) -> dict:
    """PEFT's adapter_config.json for these adapters (the modules named in full, so nothing else of
    the base matches)."""
    settings = lora.settings
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": lora.base,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": module_names, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "init_lora_weights": True}


def hub_to_module_names(model_cfg: ModelConfig) -> dict[str, str]:
    """Hub-style tensor name -> the name of that tensor in the transformers model as instantiated
    (they differ where transformers renamed modules but reads the Hub's names, e.g. Qwen2.5-VL's
    ``model.layers.*`` lives at ``model.language_model.layers.*``). PEFT finds modules by the
    instantiated names, so an adapter folder must use them. The model is built on the meta device."""
    # lazy: only the adapter export instantiates a transformers model
    import transformers

    family = get_family(model_cfg.family)
    hf_config = family.config_to_hf(model_cfg, "float32")
    model_class = getattr(transformers, family.hf_model_class)
    level = transformers.logging.get_verbosity()
    # Only names are read: the config's checks of token ids against the vocabulary would only be noise.
    transformers.logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.for_model(**hf_config)
        with torch.device("meta"):
            model = model_class.from_config(config) if model_class.__name__.startswith("Auto") else model_class(config)
    finally:
        transformers.logging.set_verbosity(level)
    return {next(iter(family.to_hub_style({name: None}))): name for name in model.state_dict()}


def write_adapter_folder(folder: Path, tensors: dict[str, torch.Tensor], lora: CheckpointLora,
                         model_cfg: ModelConfig) -> None:
    """``tensors``: PEFT's names for the Hub-style model, without the wrapper prefix -> tensor; written
    under the instantiated model's module names."""
    module_of = hub_to_module_names(model_cfg)

    def instantiated(name: str) -> str:
        linear, _, matrix = name.rpartition(".lora_")  # "<linear>" and "A.weight"
        return module_of[linear + _WEIGHT][: -len(_WEIGHT)] + ".lora_" + matrix

    tensors = {instantiated(name): tensor for name, tensor in tensors.items()}
    modules = sorted({name.rsplit(".lora_", 1)[0] for name in tensors})
    save_file({PEFT_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()},
              str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, modules), indent=2) + "\n")
