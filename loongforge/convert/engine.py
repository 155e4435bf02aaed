"""The conversion engine: HF <-> megatron-core checkpoints, one tensor (or one layer) at a time.

A conversion is a list of ``Link``s, one per row of the family's mapping table and layer: the HF
tensor(s) on one side, one global megatron chunk on the other. The megatron side is always the
*global* layout of dist_checkpointing (TP=1 tensors, language layers stacked on a leading axis),
so it is the mapping table's transform at TP size 1; tensor/pipeline layouts are dist_checkpointing's
business at load time. Each link is converted when the writer asks for it, so peak memory is a
few tensors, not the model.

Folder writes go to ``.<DST>.tmp-<pid>`` beside DST and are renamed into place at the end: an error
or a kill never leaves a half-written DST. The folder is removed on every exit a process can handle
(errors; SIGINT / SIGTERM through the CLI), and the next conversion to DST removes those of
processes that could not (SIGKILL).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from loongforge import __version__
from loongforge.config.errors import ConfigError, InputError
from loongforge.config.layout import LayoutKeys, layout_problems
from loongforge.config.loader import load_resolved_config, load_run_config
from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.convert import families
from loongforge.convert.checkpoint_folders import META_FILE, MODEL_ONLY_KIND, latest_checkpoint
from loongforge.convert.hf_io import (
    DEFAULT_SHARD_BYTES,
    LAYOUT_FILE,
    FileLayout,
    HFCheckpoint,
    PlannedTensor,
    SafetensorsStreamWriter,
    is_hf_folder,
    plan_files,
    write_index,
)
from loongforge.convert.mcore_io import (
    MODEL_DIR,
    McoreItem,
    McoreReader,
    is_mcore_folder,
    stack_index,
    stacked,
    unstacked,
    write_mcore,
)
from loongforge.convert.lora_export import (
    CheckpointLora,
    checked_base,
    checkpoint_lora,
    merged_chunk,
    refuse_unexportable,
    write_adapter_folder,
)
from loongforge.convert.serving import write_serving_files
from loongforge.models.family import ModelFamily
from loongforge.models.flops import layers_keyed_apart
from loongforge.models.hf.rules import LANGUAGE, VISION, Copies, Rule, Vocab
from loongforge.models.layers.lora_params import lora_rules
from loongforge.models.registry import family_of_hf_config, get_family
from loongforge.models.hf.state_dict_names import fused_name, is_adapter_key

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_SUBDIR = "hf"  # config.json, tokenizer/processor files and the file layout kept beside a converted megatron checkpoint


# ---------------------------------------------------------------------------------------------
# Links: the mapping table unrolled over layers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    rule: Rule
    hf_keys: tuple[str, ...]  # Hub style
    mcore_key: str  # global dist_checkpointing key
    layer: Optional[int]  # index on the stacked layer axis; None: not stacked
    expert: Optional[int] = None  # index on the expert axis after the layer axis; None: none
    # A hybrid decoder's layer whose tensors have keys of their own (``layers.<block>.``); None: none.
    block: Optional[int] = None

    @property
    def stack(self) -> tuple[int, ...]:
        return stack_index(self.layer, self.expert)


def _fill(pattern: str, index: int, expert: Optional[int] = None) -> str:
    pattern = pattern.replace("{i}", str(index))
    return pattern if expert is None else pattern.replace("{e}", str(expert))


def family_of(model_cfg: ModelConfig) -> ModelFamily:
    """The family a model config belongs to (``model.family``)."""
    return get_family(model_cfg.family)


def vocab_rows_at(model_cfg: ModelConfig, tp: int) -> int:
    """Rows of the embedding and output layer at TP size ``tp`` (the family's vocabulary padding)."""
    return family_of(model_cfg).padded_vocab_size(model_cfg.language.vocab_size, tp)


def model_config_of(hf_config: dict, where: str) -> ModelConfig:
    """``ModelConfig`` of an HF ``config.json``, read by the family that names its architecture."""
    return family_of_hf_config(hf_config, where).config_from_hf(hf_config, where)


def build_links(model_cfg: ModelConfig, rules: Optional[list[Rule]] = None) -> list[Link]:
    """Every tensor of the model (or of ``rules``, e.g. the LoRA adapters' map), vision first, in
    layer order. A tied model has no output layer."""
    links, apart = [], layers_keyed_apart(model_cfg.language)
    for rule in family_of(model_cfg).hf_rules(model_cfg) if rules is None else rules:
        if rule.fallback_hf and model_cfg.language.tie_word_embeddings:
            continue  # megatron keeps one embedding; HF's tied checkpoints have no lm_head
        if "{i}" not in rule.megatron and "{e}" in rule.megatron:
            # A layer outside the decoder's stack (multi-token prediction's): its own keys, experts stacked.
            key = rule.megatron.replace("local_experts.{e}.", "experts.")
            if rule.fuses_experts:
                links.append(Link(rule, rule.hf, key, None))
                continue
            links += [Link(rule, tuple(p.replace("{e}", str(e + rule.expert_offset)) for p in rule.hf), key, None, e)
                      for e in range(model_cfg.language.moe.num_experts)]
        elif "{i}" not in rule.megatron:
            links.append(Link(rule, rule.hf, rule.megatron, None))
        elif rule.group == VISION:  # vision blocks are separate keys per block
            links += [Link(rule, tuple(_fill(p, i) for p in rule.hf), _fill(rule.megatron, i), None)
                      for i in range(model_cfg.vision.depth if rule.count is None else rule.count)]
        elif "{e}" in rule.megatron and apart:
            # Layers that differ in tensors are keys of their own; each stacks its experts (axis 0).
            for i in _language_layers(rule, model_cfg):
                key = _fill(rule.megatron, i).replace("local_experts.{e}.", "experts.")
                if rule.fuses_experts:
                    links.append(Link(rule, tuple(_fill(p, i) for p in rule.hf), key, None, block=i))
                    continue
                links += [Link(rule, tuple(_fill(p, i, e + rule.expert_offset) for p in rule.hf), key, None, e, block=i)
                          for e in range(model_cfg.language.moe.num_experts)]
        elif "{e}" in rule.megatron:  # experts: one key, stacked over (global layer, global expert)
            key = rule.megatron.replace("layers.{i}.", "layers.").replace("local_experts.{e}.", "experts.")
            if rule.fuses_experts:  # one HF tensor holds a layer's experts: one link per layer
                links += [Link(rule, tuple(_fill(p, i) for p in rule.hf), key, i)
                          for i in _language_layers(rule, model_cfg)]
                continue
            links += [Link(rule, tuple(_fill(p, i, e + rule.expert_offset) for p in rule.hf), key, i, e)
                      for i in _language_layers(rule, model_cfg)
                      for e in range(model_cfg.language.moe.num_experts)]
        elif apart:
            # The layers differ in tensors (hybrid, or dense then sparse), so megatron keeps each under keys of
            # its own.
            links += [Link(rule, tuple(_fill(p, i) for p in rule.hf), _fill(rule.megatron, i), None, block=i)
                      for i in _language_layers(rule, model_cfg)]
        else:  # language layers: one key, stacked on axis 0 over the global layer index
            key = rule.megatron.replace("layers.{i}.", "layers.")
            links += [Link(rule, tuple(_fill(p, i) for p in rule.hf), key, i)
                      for i in _language_layers(rule, model_cfg)]
    order = {VISION: 0, LANGUAGE: 1}
    return sorted(links, key=lambda link: order[link.rule.group])  # stable: table order within


def _language_layers(rule: Rule, model_cfg: ModelConfig) -> range | tuple[int, ...]:
    """The decoder layers a language rule's ``{i}`` runs over."""
    return range(model_cfg.language.num_layers) if rule.layers is None else rule.layers


def _vocab(transform) -> Optional[Vocab]:
    """The vocabulary transform of an embedding or output-layer rule (its copies' too), else None."""
    transform = transform.base if isinstance(transform, Copies) else transform
    return transform if isinstance(transform, Vocab) else None


def to_megatron(link: Link, hf: list[torch.Tensor], vocab_rows: int) -> torch.Tensor:
    """HF tensor(s) -> the link's global megatron chunk (TP=1 layout, vocabulary padded)."""
    vocab = _vocab(link.rule.transform)
    if vocab is not None and hf[0].shape[0] == vocab.vocab_size == vocab_rows:
        tensor = hf[0]  # no padding needed: spare the transform's copy of the largest tensor
    else:
        tensor = link.rule.transform.shard(hf, 0, 1)
    if vocab is not None and tensor.shape[0] != vocab_rows:
        padding = tensor.new_zeros(vocab_rows - tensor.shape[0], *tensor.shape[1:])
        tensor = torch.cat([tensor[: vocab.vocab_size], padding])
    return stacked(tensor, link.stack)


def to_hf(link: Link, chunk: torch.Tensor) -> list[torch.Tensor]:
    """The link's global megatron tensor (one layer's slice if stacked) -> HF tensor(s)."""
    vocab = _vocab(link.rule.transform)
    if vocab is not None:  # drop the padding rows without a copy (each HF copy its own tensor)
        rows = chunk[: vocab.vocab_size]
        return [rows] + [rows.clone() for _ in link.hf_keys[1:]]
    return link.rule.transform.unshard([chunk])


def megatron_shapes(links: list[Link], hf_shapes: dict[str, tuple[int, ...]], model_cfg: ModelConfig,
                    vocab_rows: int) -> dict[str, tuple[int, ...]]:
    """Global shape of every megatron key, computed on meta tensors through the transforms."""
    shapes = {}
    for link in links:
        if link.mcore_key in shapes:
            continue
        hf = [torch.empty(hf_shapes[k], device="meta") for k in link.hf_keys]
        chunk = to_megatron(link, hf, vocab_rows)
        leading = (*((model_cfg.language.num_layers,) if link.layer is not None else ()),
                   *((model_cfg.language.moe.num_experts,) if link.expert is not None else ()))
        shapes[link.mcore_key] = (*leading, *chunk.shape[len(link.stack):])
    return shapes


# ---------------------------------------------------------------------------------------------
# Progress and folders
# ---------------------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """tqdm bar in tensors (the rate is tensors/s) with the bytes written so far as postfix."""

    def __init__(self, total: int, label: str, enabled: bool):
        from tqdm import tqdm  # lazy: every training rank imports this module (model_io) and draws no bar

        self.bytes = 0
        self.tensors = 0
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, desc=label, unit="tensor", disable=not enabled, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.tensors += 1
        self.bar.update(1)
        self.bar.set_postfix_str(_human(self.bytes), refresh=False)

    def close(self) -> float:
        self.bar.close()
        return time.perf_counter() - self.start


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_staging(dst: Path) -> list[str]:
    """Remove ``.<DST>.tmp-<pid>`` folders beside ``dst`` whose process is gone.

    A conversion killed by SIGKILL (or the OOM killer, or a reboot) cannot clean up after itself,
    and its folder is as large as the output. Folders of live processes are left alone; so are
    ``.old-<pid>`` ones, which may hold the only copy of a DST being replaced. Returns one note per
    folder removed."""
    notes = []
    for candidate in dst.parent.glob(f".{glob.escape(dst.name)}.tmp-*"):
        pid = candidate.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        notes.append(f"removed {candidate.name}, left by process {pid} which no longer runs")
    return notes


@contextmanager
def staged_folder(dst: Path, overwrite: bool, notes: Optional[list[str]] = None) -> Iterator[Path]:
    """A temporary folder beside ``dst``, renamed to ``dst`` when the body succeeds, removed if not
    (any exception, including the ones the CLI raises for SIGINT / SIGTERM). Stale folders of dead
    conversions to the same ``dst`` are removed first and noted in ``notes``."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise InputError(f"{dst}: already exists; pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_staging(dst)
    if notes is not None:
        notes.extend(stale)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _copy_side_files(files: list[Path], dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, dst / f.name)
    return [f.name for f in files]


@dataclass
class ConversionReport:
    direction: str
    src: str
    dst: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verify_mismatches: Optional[list[str]] = None
    notes: list[str] = field(default_factory=list)
    # Settings of copied processor files that differ from the run's, and serving files not written
    # (``serving``), one line each.
    serving_warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.bytes / self.seconds if self.seconds else 0.0
        text = (f"converted {self.tensors} tensors ({_human(self.bytes)}) {self.src} -> {self.dst} "
                f"[{self.direction}] in {self.seconds:.1f}s ({_human(rate)}/s)")
        if self.verify_mismatches is not None:
            text += (" | verify: all tensors equal" if not self.verify_mismatches else
                     f" | verify: {len(self.verify_mismatches)} tensors differ ({self.verify_mismatches[0]}, ...)")
        return "\n".join([" | ".join([text, *self.notes]), *self.serving_warnings])


# ---------------------------------------------------------------------------------------------
# Source checks
# ---------------------------------------------------------------------------------------------


def _preset_model(preset: str) -> ModelConfig:
    return load_run_config(preset).model


def check_hf_tensors(src: HFCheckpoint, model_cfg: ModelConfig, against: str) -> dict[str, tuple[int, ...]]:
    """Every tensor present with the shape ``model_cfg`` implies (or another layout its transform
    reads), and nothing else; errors name the file and the tensor. Returns the expected shapes."""
    family = family_of(model_cfg)
    expected = family.hf_shapes(model_cfg)
    transforms = {key: link.rule.transform for link in build_links(model_cfg) for key in link.hf_keys}
    for key, shape in expected.items():
        entry = src.entries.get(key)
        if entry is None:
            raise InputError(f"{src.root}: tensor {key} is missing (required by {against})")
        if entry.shape != shape and not (key in transforms and transforms[key].accepts_hf_shape(entry.shape)):
            raise InputError(f"{entry.file}: tensor {entry.key} has shape {list(entry.shape)} but {against} "
                             f"expects {list(shape)}")
    for key, entry in src.entries.items():
        if key.startswith(family.hf_unread):
            continue
        if key not in expected and not (key == "lm_head.weight" and model_cfg.language.tie_word_embeddings):
            raise InputError(f"{entry.file}: unexpected tensor {entry.key}: not part of a {family.name} model with "
                             f"{against}")
    return expected


def unread_note(src: HFCheckpoint, model_cfg: ModelConfig) -> list[str]:
    """One line per prefix of the family's ``hf_unread`` whose tensors ``src`` holds: how many were not read."""
    notes = []
    for prefix in family_of(model_cfg).hf_unread:
        count = sum(key.startswith(prefix) for key in src.entries)
        if count:
            notes.append(f"{count} tensors under {prefix} not read (no place for them in this model)")
    return notes


def check_layout(model_cfg: ModelConfig, tp: int, pp: int, vision_tp: Optional[int], *, vp: Optional[int] = None,
                 pipeline_layout: Optional[str] = None) -> None:
    """The layout a converted checkpoint is meant for must be one the model can be built at: the
    family's layout rule, the one training's config validation applies, named by this command's flags.
    (The checkpoint itself does not depend on it: tensors hold global layer indices.)"""
    problems = layout_problems(model_cfg, family_of(model_cfg).layout, tp=tp, pp=pp, vision_tp=vision_tp, vp=vp,
                               pipeline_layout=pipeline_layout,
                               keys=LayoutKeys(tensor="--tp", pipeline="--pp", vision_tensor="--vision-tp",
                                               virtual="--vp", pipeline_layout="--pipeline-layout"))
    if problems:
        raise ConfigError(problems)


# ---------------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------------


def hf_to_mcore(src: Path, dst: Path, *, preset: Optional[str] = None, tp: int = 1, pp: int = 1,
                vision_tp: Optional[int] = None, vp: Optional[int] = None, pipeline_layout: Optional[str] = None,
                dtype: Optional[str] = None, overwrite: bool = False,
                verify: bool = False, progress: bool = True) -> ConversionReport:
    """Write a model-only checkpoint ``loongforge train checkpoint.load=DST`` starts from."""
    checkpoint = HFCheckpoint(src)
    family = checkpoint.family.name
    model_cfg = checkpoint.model_config()
    if preset:
        preset_cfg = _preset_model(preset)
        check_hf_tensors(checkpoint, preset_cfg, f"preset {preset}")
        differences = families.config_differences(preset_cfg, model_cfg)
        if differences:
            raise InputError(f"{src / 'config.json'}: does not match preset {preset}: " + "; ".join(differences))
    hf_shapes = check_hf_tensors(checkpoint, model_cfg, f"{src / 'config.json'}")
    check_layout(model_cfg, tp, pp, vision_tp, vp=vp, pipeline_layout=pipeline_layout)
    out_dtype = DTYPES[dtype] if dtype else None
    vocab_rows = vocab_rows_at(model_cfg, tp)
    links = build_links(model_cfg)
    global_shapes = megatron_shapes(links, hf_shapes, model_cfg, vocab_rows)

    def produce(link: Link) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            tensor = to_megatron(link, [checkpoint.load(k) for k in link.hf_keys], vocab_rows)
            return tensor.to(item_dtype(link))
        return make

    def item_dtype(link: Link) -> torch.dtype:
        return out_dtype or checkpoint.entries[link.hf_keys[0]].dtype

    items = [McoreItem(link.mcore_key, global_shapes[link.mcore_key], item_dtype(link), link.layer, produce(link),
                       expert=link.expert) for link in links]
    report = ConversionReport("hf->mcore", str(src), str(dst))
    report.notes.extend(unread_note(checkpoint, model_cfg))
    bar = Progress(len(items), "hf -> mcore", progress)
    with staged_folder(dst, overwrite, report.notes) as tmp:
        write_mcore(tmp / MODEL_DIR, items, lambda item, tensor: bar.update(tensor.nbytes))
        copied = _copy_side_files(checkpoint.side_files(("config.json", *families.HF_SIDE_FILES)), tmp / HF_SUBDIR)
        # config.json as the folder wrote it (an export writes it back); the layout names the tensors converted,
        # which is what the checkpoint holds where the config names more (``mcore_model_config``).
        checkpoint.layout().write(tmp / HF_SUBDIR / LAYOUT_FILE)
        (tmp / META_FILE).write_text(json.dumps({
            "kind": MODEL_ONLY_KIND, "step": 0, "family": family,
            "layout": {"tp": tp, "pp": pp, "vision_tp": vision_tp or tp},
            "source": str(src), "hf_files": copied, "loongforge": __version__,
        }, indent=2) + "\n")
        report.seconds = bar.close()
        report.tensors, report.bytes = bar.tensors, bar.bytes
        if verify:
            report.verify_mismatches = _verify_mcore(tmp, links, checkpoint, vocab_rows, item_dtype, progress)
    return report


def _verify_mcore(folder: Path, links: list[Link], checkpoint: HFCheckpoint, vocab_rows: int,
                  item_dtype: Callable[[Link], torch.dtype], progress: bool) -> list[str]:
    reader = McoreReader(folder / MODEL_DIR)
    bar = Progress(len(links), "verify", progress)
    mismatches = []
    for link in links:
        expected = to_megatron(link, [checkpoint.load(k) for k in link.hf_keys], vocab_rows).to(item_dtype(link))
        written = reader.read(link.mcore_key, link.layer, link.expert)
        if not torch.equal(written, unstacked(expected, link.stack)):
            mismatches.append(link.mcore_key + ("" if link.layer is None else str(list(link.stack))))
        bar.update(written.nbytes)
    bar.close()
    return mismatches


# ---------------------------------------------------------------------------------------------
# megatron -> HF
# ---------------------------------------------------------------------------------------------


def resolve_mcore_checkpoint(src: Path) -> Path:
    """A ``step_*`` folder (or a converted checkpoint) from itself or a checkpoint root."""
    if is_mcore_folder(src):
        return src
    latest = latest_checkpoint(src) if src.is_dir() else None
    if latest is not None and is_mcore_folder(latest):
        return latest
    raise InputError(f"{src}: neither an HF folder (config.json + *.safetensors) nor a loongforge "
                     f"checkpoint (step folder with {MODEL_DIR}/, or a root with step_* folders)")


def _run_config_near(step_dir: Path) -> Optional[Path]:
    """``config.yaml`` of the run that wrote ``<run>/checkpoints/step_*`` (or ``<run>/step_*``)."""
    for parent in list(step_dir.resolve().parents)[:3]:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


def mcore_model_config(step_dir: Path, preset: Optional[str]) -> tuple[ModelConfig, Optional[dict]]:
    """The model config of a megatron checkpoint and the HF config.json it came from, if any."""
    hf_config_file = step_dir / HF_SUBDIR / "config.json"
    hf_config = json.loads(hf_config_file.read_text()) if hf_config_file.is_file() else None
    found, source = None, None
    if hf_config is not None:
        found, source = model_config_of(hf_config, str(hf_config_file)), str(hf_config_file)
        layout = FileLayout.read(step_dir / HF_SUBDIR / LAYOUT_FILE)
        if layout is not None:  # the parts the converted tensors hold (DeepSeek-V3's config names an MTP layer none held)
            found = family_of(found).config_for_tensors(found, layout.files.keys())
    elif (run_config := _run_config_near(step_dir)) is not None:
        found, source = load_resolved_config(run_config).model, str(run_config)
    if preset:
        preset_cfg = _preset_model(preset)
        if found is not None:
            differences = families.config_differences(preset_cfg, found)
            if differences:
                raise InputError(f"{source}: does not match preset {preset}: " + "; ".join(differences))
        return preset_cfg, hf_config
    if found is None:
        raise InputError(f"{step_dir}: no model config found (no {HF_SUBDIR}/config.json, no run config.yaml "
                         f"above it); pass --preset NAME")
    return found, hf_config


def mcore_data_config(step_dir: Path, preset: Optional[str]) -> tuple[DataConfig, Optional[str]]:
    """The data settings a megatron checkpoint was trained with (its run's config.yaml, else
    ``--preset``'s), which size the exported processor and pick its tokenizer; without either, the
    defaults and a note saying so."""
    if (run_config := _run_config_near(step_dir)) is not None:
        return load_resolved_config(run_config).data, None
    if preset:
        return load_run_config(preset).data, None
    return DataConfig(), (f"no run config.yaml near {step_dir}: tokenizer and processor files not found beside "
                          f"it are written from the default data settings; pass --preset NAME for a preset's")


def resolve_checkpoint_keys(reader: McoreReader, links: list[Link], shapes: dict[str, tuple[int, ...]],
                  vocab_size: int) -> dict[str, str]:
    """Our global key -> the key in the checkpoint (fused or separate norm names; a key our map
    itself names, such as a mixture-of-experts layer's own ``pre_mlp_layernorm``, as it is)."""
    model_keys = [key for key in reader.tensors if not key.startswith("optimizer.")]
    exact = set(model_keys)
    available = {fused_name(key): key for key in model_keys}
    resolved = {}
    for link in links:
        if link.mcore_key in resolved:
            continue
        actual = link.mcore_key if link.mcore_key in exact else available.get(link.mcore_key)
        if actual is None:
            raise InputError(f"{reader.folder}: tensor {link.mcore_key} is missing from the checkpoint")
        found, expected = reader.shape(actual), shapes[link.mcore_key]
        vocab_ok = _vocab(link.rule.transform) is not None and found[1:] == expected[1:] and found[0] >= vocab_size
        if found != expected and not vocab_ok:
            hint = (" (saved with vision TP > 1, which stores only TP rank 0's shard of vision blocks)"
                    if link.rule.group == VISION else "")
            raise InputError(f"{reader.folder}: tensor {actual} has shape {list(found)}, the model config "
                             f"expects {list(expected)}{hint}")
        resolved[link.mcore_key] = actual
    return resolved


@dataclass
class _BaseWeights:
    """Where an export reads the base model's tensors: the checkpoint itself, or (a LoRA checkpoint
    that keeps its adapters only) the base it records, a loongforge checkpoint or an HF folder."""

    chunk: Callable[[Link], torch.Tensor]  # a link's whole megatron tensor, one layer's if stacked
    dtype: Callable[[Link], torch.dtype]
    where: str


def _base_weights(reader: McoreReader, links: list[Link], shapes: dict, model_cfg: ModelConfig,
                  lora: Optional[CheckpointLora], vocab_rows: int) -> _BaseWeights:
    base_in_checkpoint = any(not is_adapter_key(key) and not key.startswith("optimizer.") for key in reader.tensors)
    if lora is None or base_in_checkpoint:
        return _mcore_base(reader, links, shapes, model_cfg)
    base = checked_base(lora, Path(reader.folder).parent)
    if is_hf_folder(base):
        hf = HFCheckpoint(base)
        return _BaseWeights(lambda link: unstacked(to_megatron(link, [hf.load(k) for k in link.hf_keys], vocab_rows),
                                                   link.stack),
                            lambda link: hf.entries[link.hf_keys[0]].dtype, str(base))
    return _mcore_base(McoreReader(resolve_mcore_checkpoint(base) / MODEL_DIR), links, shapes, model_cfg)


def _mcore_base(reader: McoreReader, links: list[Link], shapes: dict, model_cfg: ModelConfig) -> _BaseWeights:
    keys = resolve_checkpoint_keys(reader, links, shapes, model_cfg.language.vocab_size)
    return _BaseWeights(lambda link: reader.read(keys[link.mcore_key], link.layer, link.expert),
                        lambda link: reader.dtype(keys[link.mcore_key]), str(reader.folder))


def _link_reader(reader: McoreReader, link: Link) -> Callable[[str], Optional[torch.Tensor]]:
    """A checkpoint key -> that tensor's slice at ``link``'s layer and expert (None: no such key)."""
    return lambda key: reader.read(key, link.layer, link.expert) if key in reader.tensors else None


def mcore_to_hf(src: Path, dst: Path, *, preset: Optional[str] = None, dtype: Optional[str] = None,
                max_shard_size: Optional[int] = None, overwrite: bool = False, verify: bool = False,
                progress: bool = True, model_cfg: Optional[ModelConfig] = None,
                data_cfg: Optional[DataConfig] = None, hf_source: Optional[Path] = None,
                adapter: bool = False) -> ConversionReport:
    """Hub-style safetensors shards, index, config.json, and the tokenizer, processor and generation
    files (``serving``) from a megatron checkpoint; a LoRA run's with its adapters merged
    (``convert.lora_export``), or with ``adapter`` its adapters alone as a PEFT folder. Without
    ``max_shard_size`` the tensors go to the files (and index, or none) of the HF folder the checkpoint was
    converted from (``hf_io.FileLayout``), else to shards of 5 GB.

    ``model_cfg`` / ``data_cfg`` / ``hf_source`` (a folder with config.json and tokenizer files) are
    given by ``loongforge train``; otherwise they are found beside the checkpoint (or from ``--preset``).
    """
    step_dir = resolve_mcore_checkpoint(Path(src))
    hf_source = hf_source or step_dir / HF_SUBDIR
    data_note = None
    if data_cfg is None:
        data_cfg, data_note = mcore_data_config(step_dir, preset)
    if model_cfg is None:
        model_cfg, hf_config = mcore_model_config(step_dir, preset)
    else:
        config_file = hf_source / "config.json"
        hf_config = json.loads(config_file.read_text()) if config_file.is_file() else None
    _check_exportable(model_cfg)
    reader = McoreReader(step_dir / MODEL_DIR)
    lora = checkpoint_lora(step_dir, reader.tensors, _run_config_near(step_dir))
    if adapter:
        return _export_adapters(step_dir, reader, dst, model_cfg, lora, overwrite=overwrite, progress=progress)
    links = build_links(model_cfg)
    hf_shapes = family_of(model_cfg).hf_shapes(model_cfg)
    vocab_rows = vocab_rows_at(model_cfg, 1)
    shapes = megatron_shapes(links, hf_shapes, model_cfg, vocab_rows)
    base = _base_weights(reader, links, shapes, model_cfg, lora, vocab_rows)
    out_dtype = DTYPES[dtype] if dtype else None
    planned = [PlannedTensor(k, out_dtype or base.dtype(link), hf_shapes[k]) for link in links for k in link.hf_keys]
    # No size asked for: the files of the HF folder the checkpoint was converted from, where it names them.
    layout = _source_layout(hf_source) if max_shard_size is None else None
    plan = plan_files(planned, layout, max_shard_size or DEFAULT_SHARD_BYTES)
    shards, names = plan.shards, plan.names
    file_of = {t.key: (i, name) for i, (shard, name) in enumerate(zip(shards, names)) for t in shard}

    def hf_tensors(link: Link) -> list[torch.Tensor]:
        chunk = base.chunk(link)
        if lora is not None:
            chunk = merged_chunk(link, chunk, _link_reader(reader, link), lora, hf_shapes)
        return to_hf(link, chunk)

    report = ConversionReport("mcore->hf", str(step_dir), str(dst))
    if lora is not None:
        report.notes.append(f"LoRA adapters (rank {lora.settings.rank}, alpha {lora.settings.alpha:g}) merged into "
                            f"the base weights from {base.where}")
    bar = Progress(len(planned), "mcore -> hf", progress)
    with staged_folder(dst, overwrite, report.notes) as tmp:
        # A source's files may interleave in the links' order: each file open until its last tensor is written.
        writers: dict[int, SafetensorsStreamWriter] = {}
        for link in links:
            for key, tensor in zip(link.hf_keys, hf_tensors(link)):
                index, name = file_of[key]
                if index not in writers:
                    writers[index] = SafetensorsStreamWriter(tmp / name, shards[index])
                tensor = tensor.to(out_dtype) if out_dtype else tensor
                writers[index].write(key, tensor)
                bar.update(tensor.nbytes)
                if writers[index].position == len(shards[index]):
                    writers.pop(index).close()
        for writer in writers.values():
            writer.close()
        if plan.indexed:
            write_index(tmp, shards, names)
        config = hf_config or family_of(model_cfg).config_to_hf(model_cfg, _dtype_name(planned[0].dtype))
        if out_dtype is not None:
            config = {**config, "torch_dtype": _dtype_name(out_dtype)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        serving = write_serving_files(tmp, model_cfg, data_cfg, hf_source)
        report.serving_warnings = serving.warnings
        if serving.copied:
            report.notes.append(f"{', '.join(serving.copied)} files copied from {hf_source}")
        if serving.written:
            report.notes.append(f"{', '.join(serving.written)} files written from the run's settings")
            if data_note and {"tokenizer", "processor"} & set(serving.written):
                report.notes.append(data_note)
        report.seconds = bar.close()
        report.tensors, report.bytes = bar.tensors, bar.bytes
        if verify:
            report.verify_mismatches = _verify_hf(tmp, links, hf_tensors, out_dtype, progress)
    return report


def _source_layout(hf_source: Path) -> Optional[FileLayout]:
    """The files of the HF folder a checkpoint came from: kept beside a converted one (``hf_to_mcore``), or
    those of the folder itself (a run's ``checkpoint.load_hf``)."""
    kept = FileLayout.read(hf_source / LAYOUT_FILE)
    if kept is not None or not is_hf_folder(hf_source):
        return kept
    try:
        return HFCheckpoint(hf_source).layout()
    except InputError:  # a folder this export takes only its tokenizer and processor files from
        return None


def _check_exportable(model_cfg: ModelConfig) -> None:
    """An HF export needs a transformers class for the model: a composition none describes is refused
    here, in one line, before anything is read or written."""
    try:
        family_of(model_cfg).config_to_hf(model_cfg)
    except ValueError as error:
        raise InputError(str(error)) from None


def _export_adapters(step_dir: Path, reader: McoreReader, dst: Path, model_cfg: ModelConfig,
                     lora: Optional[CheckpointLora], *, overwrite: bool, progress: bool) -> ConversionReport:
    """The checkpoint's adapters as a PEFT folder (``convert.lora_export``)."""
    if lora is None:
        raise InputError(f"{step_dir}: holds no LoRA adapters (lora.rank was 0); --adapter exports a LoRA run's "
                         f"adapters: drop --adapter to export the model")
    links = build_links(model_cfg, lora_rules(model_cfg))
    refuse_unexportable(lora, model_cfg, links, step_dir)
    report = ConversionReport("mcore->peft", str(step_dir), str(dst))
    present = [link for link in links if link.mcore_key in reader.tensors]
    bar = Progress(len(present), "mcore -> peft", progress)
    tensors = {}
    with staged_folder(dst, overwrite, report.notes) as tmp:
        for link in present:
            for key, tensor in zip(link.hf_keys, to_hf(link, reader.read(link.mcore_key, link.layer, link.expert))):
                tensors[key] = tensor
                bar.update(tensor.nbytes)
        write_adapter_folder(tmp, tensors, lora, model_cfg)
        report.seconds = bar.close()
        report.tensors, report.bytes = bar.tensors, bar.bytes
    report.notes.append(f"PEFT adapters for {len({k.rsplit('.lora_', 1)[0] for k in tensors})} linears; load with "
                        f"peft.PeftModel.from_pretrained(base, {dst})")
    return report


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(dtype, "float32")


def _verify_hf(folder: Path, links: list[Link], hf_tensors: Callable[[Link], list[torch.Tensor]],
               out_dtype: Optional[torch.dtype], progress: bool) -> list[str]:
    written = HFCheckpoint(folder)
    bar = Progress(len(written.entries), "verify", progress)
    mismatches = []
    for link in links:
        for key, tensor in zip(link.hf_keys, hf_tensors(link)):
            actual = written.load(key)
            if not torch.equal(actual, tensor.to(out_dtype) if out_dtype else tensor):
                mismatches.append(key)
            bar.update(actual.nbytes)
    bar.close()
    return mismatches


def convert(src: Path, dst: Path, *, to: str, **kwargs) -> ConversionReport:
    """Detect SRC's format and convert it to ``to`` ("mcore" or "hf")."""
    src = Path(src)
    if not src.exists():
        raise InputError(f"{src}: no such file or folder")
    source_is_hf = is_hf_folder(src) or (src / "config.json").is_file()
    if to == "mcore":
        if not source_is_hf:
            raise InputError(f"{src}: --to mcore needs an HF folder (config.json + *.safetensors)")
        kwargs.pop("max_shard_size", None)
        return hf_to_mcore(src, dst, **kwargs)
    if to == "hf":
        if source_is_hf:
            raise InputError(f"{src}: is already an HF checkpoint; use --to mcore")
        for unused in ("tp", "pp", "vision_tp", "vp", "pipeline_layout"):
            kwargs.pop(unused, None)
        return mcore_to_hf(src, dst, **kwargs)
    raise ConfigError(f"--to={to!r} must be 'mcore' or 'hf'")
