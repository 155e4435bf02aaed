"""``loongforge convert SRC --check-logits``: the family's own model against transformers, on one sample.

SRC is an HF folder, or a loongforge checkpoint first written as an HF folder into a temporary
folder (``engine.mcore_to_hf``, the conversion under test). That folder is then loaded twice, in
fp32 whatever the checkpoint's dtype:

- by transformers, through the family's class (``ModelFamily.hf_model_class``, eager attention):
  the reference;
- by loongforge, as the family's megatron-core model (``ModelFamily.build``) filled through the
  mapping table (``models.hf.weights.load_hf_state_dict``) at tensor-parallel size ``tp``: in this
  process, a gloo group of one, at TP 1; in ``tp`` spawned gloo processes on 127.0.0.1 otherwise,
  which exit when done.

Both run one built-in sample, made by the data pipeline's own pieces as training makes it (the chat
rendered and tokenized, the image sized and patchified, the row collated with its rotary
positions): a short chat, with one image for a family with vision (a scene drawn in code, or
``image``). transformers computes its own positions from the token ids, so the family's position
function is compared as well.

Compared over the true vocabulary (megatron's padding rows dropped): the largest and the mean
absolute difference of the logits and the positions whose argmax agrees; the check passes when the
largest difference is at most ``atol``. Both sides read the same tensors: what this checks is the
mapping (and, for a loongforge checkpoint, its conversion to HF) and the model, not the bytes of
SRC against another copy (``--verify`` and ``--roundtrip`` check the bytes of a conversion).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from loongforge.config.errors import InputError
from loongforge.config.loader import load_run_config
from loongforge.config.schema import DataConfig, ModelConfig, ParallelConfig
from loongforge.convert.engine import check_hf_tensors, check_layout, mcore_to_hf, resolve_mcore_checkpoint
from loongforge.convert.hf_io import HFCheckpoint, is_hf_folder
from loongforge.data.collate import collate_row
from loongforge.data.measure import MaterializedSample, MeasuredSample, SampleMeasurer, materialize, vision_sizing
from loongforge.data.samples import ConversationSample, Reject
from loongforge.data.synthetic import Scene, Shape, render_scene
from loongforge.data.template import IMAGE_PLACEHOLDER, Turn, render_chat, tokenize_chat
from loongforge.data.tokenizer import load_tokenizer
from loongforge.models.family import ChatFormat, ModelFamily
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.registry import get_family
from loongforge.parallel.distributed import init_model_parallel, shutdown
from loongforge.parallel.console import quiet_process
from loongforge.parallel.launch_env import free_port, order_tensor_parallel_kernels
from loongforge.parallel.spawned import run_to_the_end

DEFAULT_ATOL = 1e-4  # fp32 on both sides: reductions in another order stay far below this
# 140 x 112 px: a 10 x 8 patch grid (20 LLM tokens), and attention windows of 8 x 8 patches that
# the 10-patch width cuts short, so the window bookkeeping is exercised too.
BUILTIN_SCENE = Scene(width=140, height=112, background="white",
                      shapes=(Shape("circle", "red", 0), Shape("triangle", "blue", 3)))
TEXT_TURNS = (Turn("user", "What is the capital of France? Answer in one word."), Turn("assistant", "Paris."))
VISION_TURNS = (Turn("user", f"{IMAGE_PLACEHOLDER}What is in the picture?"),
                Turn("assistant", "A red circle at the top left and a blue triangle at the bottom right."))
WORKER_TIMEOUT_S = 600  # a collective waiting longer than this for a dead rank fails

Say = Callable[[str], None]


@dataclass
class CheckLogitsReport:
    src: str
    family: str
    hf_model_class: str
    tp: int
    sample: str  # what was run, in words
    tokens: int
    vocab_size: int
    max_abs_diff: float
    mean_abs_diff: float
    argmax_agree: int  # positions (of ``tokens``) where both models' most likely next token is the same
    reference_max_abs_logit: float  # the scale the differences are measured against
    atol: float
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= self.atol

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def text(self) -> str:
        verdict = (f"PASS: max abs diff {self.max_abs_diff:.3e} <= atol {self.atol:.1e}" if self.passed else
                   f"FAIL: max abs diff {self.max_abs_diff:.3e} > atol {self.atol:.1e}; loongforge's model does "
                   f"not compute what transformers computes from these weights")
        return "\n".join([
            f"check logits: {self.src} ({self.family}): loongforge at TP {self.tp} vs transformers "
            f"{self.hf_model_class}, fp32",
            f"sample: {self.sample}, {self.tokens} tokens",
            *(f"note: {note}" for note in self.notes),
            f"max abs diff    {self.max_abs_diff:.3e}  (over the {self.vocab_size} vocabulary logits; "
            f"largest reference |logit| {self.reference_max_abs_logit:.3g})",
            f"mean abs diff   {self.mean_abs_diff:.3e}",
            f"argmax agree    {self.argmax_agree}/{self.tokens}",
            f"verdict: {verdict}",
        ])


def check_logits(src: Path, *, image: Optional[Path] = None, tp: int = 1, vision_tp: Optional[int] = None,
                 atol: float = DEFAULT_ATOL, preset: Optional[str] = None, say: Say = lambda message: None,
                 progress: bool = False, work_dir: Optional[Path] = None) -> CheckLogitsReport:
    """Run SRC in transformers and in loongforge at TP ``tp`` (vision TP ``vision_tp``, default
    ``tp``) on the built-in sample (with ``image`` instead of the built-in picture) and compare the
    logits. ``say`` gets one line per phase; ``progress``: a bar for a loongforge checkpoint's
    conversion to HF; ``work_dir``: where temporary folders go (default: the system's)."""
    src = Path(src)
    if not src.exists():
        raise InputError(f"{src}: no such file or folder")
    with tempfile.TemporaryDirectory(prefix="loongforge-check-logits-", dir=work_dir) as tmp:
        hf_dir, notes = _hf_folder(src, preset, Path(tmp), say, progress)
        checkpoint = HFCheckpoint(hf_dir)
        family = checkpoint.family
        model_cfg = checkpoint.model_config()
        check_hf_tensors(checkpoint, model_cfg, str(hf_dir / "config.json"))
        check_layout(model_cfg, tp, 1, vision_tp)
        if image is not None and not family.has_vision:
            raise InputError(f"--image {image}: {family.name} models are text-only; drop --image")
        sample = build_sample(model_cfg, hf_dir, image, notes)
        say(f"check logits: {sample.description}, {sample.tokens} tokens")
        say(f"check logits: transformers {family.hf_model_class} (fp32, eager attention)")
        reference = reference_logits(hf_dir, family, model_cfg, sample, progress=progress)
        say(f"check logits: loongforge {family.name} at TP {tp} (fp32)")
        ours = our_logits(hf_dir, model_cfg, sample.model_inputs, tp=tp, vision_tp=vision_tp, work_dir=Path(tmp))
    return _compare(ours, reference, CheckLogitsReport(
        src=str(src), family=family.name, hf_model_class=family.hf_model_class, tp=tp,
        sample=sample.description, tokens=sample.tokens, vocab_size=model_cfg.language.vocab_size,
        max_abs_diff=math.nan, mean_abs_diff=math.nan, argmax_agree=0, reference_max_abs_logit=math.nan,
        atol=atol, notes=notes))


def _hf_folder(src: Path, preset: Optional[str], tmp: Path, say: Say, progress: bool) -> tuple[Path, list[str]]:
    """SRC itself when it is an HF folder; else the loongforge checkpoint written as HF under ``tmp``."""
    if is_hf_folder(src) or (src / "config.json").is_file():
        return src, []
    step_dir = resolve_mcore_checkpoint(src)
    say(f"check logits: writing {step_dir} as an HF folder (temporary)")
    mcore_to_hf(step_dir, tmp / "hf", preset=preset, progress=progress)
    return tmp / "hf", [f"{step_dir} was converted to HF (convert --to hf) and checked from there"]


# ---------------------------------------------------------------------------------------------
# The sample
# ---------------------------------------------------------------------------------------------


@dataclass
class Sample:
    model_inputs: dict  # loongforge's forward: input_ids [1, L], position_ids [3, 1, L], media
    description: str

    @property
    def input_ids(self) -> torch.Tensor:
        return self.model_inputs["input_ids"]

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def build_sample(model_cfg: ModelConfig, hf_dir: Path, image: Optional[Path], notes: list[str]) -> Sample:
    """The built-in chat as training collates it (with one image for a family with vision: ``image``,
    or the built-in scene). ``notes`` gets a line for each liberty taken with it."""
    family = get_family(model_cfg.family)
    chat_format = family.chat(model_cfg)
    tokenizer = _tokenizer(hf_dir, model_cfg, chat_format, notes)
    data_cfg = DataConfig()
    if family.has_vision:
        measured, description = _measured_vision(model_cfg, tokenizer, data_cfg, image)
    else:
        chat = tokenize_chat(tokenizer, render_chat(list(TEXT_TURNS), data_cfg.system_prompt, chat_format))
        measured = MeasuredSample(sample_id="check-logits", file="<built-in>", line=0, input_ids=chat.input_ids,
                                  is_answer=chat.is_answer)
        description = "built-in text chat"
    _fit_vocabulary(measured, model_cfg, family, notes)
    sizing = vision_sizing(data_cfg, model_cfg)
    materialized = (materialize(measured, sizing) if family.has_vision
                    else MaterializedSample(sample=measured, image_pixels=[], video_pixels=[]))
    if materialized.late_reject is not None:
        raise InputError(f"--image {image}: {materialized.late_reject.detail}")
    batch = collate_row([materialized], pad_to_multiple=1, pad_token_id=model_cfg.tokens.pad_token_id,
                        position_ids=family.position_ids(model_cfg))
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "media": batch["media"]}
    return Sample(inputs, description)


def _measured_vision(model_cfg: ModelConfig, tokenizer, data_cfg: DataConfig,
                     image: Optional[Path]) -> tuple[MeasuredSample, str]:
    source = str(image) if image is not None else render_scene(BUILTIN_SCENE)
    conversation = ConversationSample(sample_id="check-logits", file=str(image or "<built-in>"), line=0,
                                      turns=list(VISION_TURNS), images=[source])
    try:
        measured = SampleMeasurer(tokenizer, data_cfg, model_cfg).measure(conversation)
    except ValueError as error:  # the tokenizer and model.tokens disagree on a vision token
        raise InputError(f"{tokenizer.name_or_path or 'the tokenizer'}: {error}") from None
    if isinstance(measured, Reject):
        raise InputError(f"--image {image}: {measured.detail}" if image is not None else measured.detail)
    (grid,) = measured.image_grids
    name = image.name if image is not None else f"built-in {BUILTIN_SCENE.width}x{BUILTIN_SCENE.height} scene"
    return measured, f"chat with one image ({name}, patch grid {list(grid)})"


def _tokenizer(hf_dir: Path, model_cfg: ModelConfig, chat_format: ChatFormat, notes: list[str]):
    """SRC's tokenizer when it ships one; else the model's offline build (``ModelFamily.offline_tokenizer``,
    else the family's tiny preset's ``data.tokenizer``)."""
    family = get_family(model_cfg.family)
    if (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer.model").is_file():
        try:
            return load_tokenizer(str(hf_dir))
        except (OSError, ValueError) as error:
            raise InputError(f"{hf_dir}: its tokenizer files cannot be loaded ({error})") from None
    spec = (family.offline_tokenizer(model_cfg) if family.offline_tokenizer
            else load_run_config(family.tiny_preset).data.tokenizer)
    notes.append(f"no tokenizer in SRC: the sample is tokenized with {spec} (loongforge's offline build)")
    return load_tokenizer(spec, chat_format.jinja_template)


def _fit_vocabulary(measured: MeasuredSample, model_cfg: ModelConfig, family: ModelFamily, notes: list[str]) -> None:
    """A text model smaller than the tokenizer (a toy model) gets its text ids folded into its
    vocabulary; a model with vision must hold the vision tokens, so it is an error there."""
    vocab_size = model_cfg.language.vocab_size
    largest = int(measured.input_ids.max())
    if largest < vocab_size:
        return
    if family.has_vision:
        raise InputError(f"the tokenizer gives id {largest}, beyond the model's vocabulary of {vocab_size}")
    measured.input_ids = np.mod(measured.input_ids, vocab_size)
    notes.append(f"token ids reach {largest}, beyond the vocabulary of {vocab_size}: taken modulo {vocab_size}")


# ---------------------------------------------------------------------------------------------
# The two models
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logits(hf_dir: Path, family: ModelFamily, model_cfg: ModelConfig, sample: Sample, *,
                     progress: bool = False) -> torch.Tensor:
    """[L, V] logits of transformers' model of ``hf_dir`` in fp32; it is freed before returning.
    ``progress``: transformers' bar while it loads the weights."""
    import transformers  # lazy: transformers (~1.5 s) only for the reference logits
    from transformers.utils import logging as hf_logging

    model_class = getattr(transformers, family.hf_model_class)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = model_class.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    logits = model(**family.hf_model_inputs(model_cfg, sample.model_inputs)).logits[0]
    del model
    return logits


def our_logits(hf_dir: Path, model_cfg: ModelConfig, inputs: dict, *, tp: int, vision_tp: Optional[int],
               work_dir: Path) -> torch.Tensor:
    """[L, V_padded] logits of the family's megatron-core model at TP ``tp``: in this process at TP 1,
    in ``tp`` spawned processes otherwise."""
    job = _Job(model_cfg=model_cfg, hf_dir=str(hf_dir), inputs=inputs, tp=tp, vision_tp=vision_tp,
               port=free_port(), threads=max(1, torch.get_num_threads() // tp), out=str(work_dir / "logits.pt"))
    if tp == 1:
        if dist.is_initialized():
            raise RuntimeError("check_logits at TP 1 runs in a process group of its own; this process has one")
        return rank_logits(job, 0)
    _spawn(job)
    return torch.load(job.out, weights_only=True)


@dataclass(frozen=True)
class _Job:
    """What every rank needs (picklable: it travels to spawned processes)."""

    model_cfg: ModelConfig
    hf_dir: str
    inputs: dict
    tp: int
    vision_tp: Optional[int]
    port: int
    threads: int
    out: str  # where rank 0 of a spawned group saves the logits


def rank_logits(job: _Job, rank: int) -> torch.Tensor:
    """One rank: build the model, fill it from the HF folder, run the sample, gather the vocabulary
    shards. Every rank returns the whole [L, V_padded] logits."""
    if job.tp == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=rank, world_size=job.tp,
                                timeout=timedelta(seconds=WORKER_TIMEOUT_S))
    try:
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=job.tp, vision_tensor_model_parallel_size=job.vision_tp,
                                      world_size=job.tp, collective_timeout_s=WORKER_TIMEOUT_S)
        init_model_parallel(parallel_cfg, seed=0, device=torch.device("cpu"))
        model = get_family(job.model_cfg.family).build(
            job.model_cfg, parallel_cfg, params_dtype=torch.float32, pre_process=True, post_process=True,
            device="cpu").eval()
        checkpoint = HFCheckpoint(Path(job.hf_dir))
        load_hf_state_dict(model, {key: checkpoint.load(key) for key in checkpoint.entries})
        with torch.no_grad():
            local = model(**job.inputs)[0]  # [L, V_padded / tp]: this rank's vocabulary shard
        shards = [torch.empty_like(local) for _ in range(job.tp)]
        dist.all_gather(shards, local.contiguous())
        return torch.cat(shards, dim=-1)
    finally:
        shutdown()


def _spawned_rank(rank: int, job: _Job) -> None:
    torch.set_num_threads(job.threads)
    # As a training run at this TP sets it (megatron's TP linears warn without it at their first call).
    order_tensor_parallel_kernels(job.tp > 1)
    logits = rank_logits(job, rank)
    if rank == 0:
        torch.save(logits, job.out)


def _spawn(job: _Job) -> None:
    """``job.tp`` processes on this machine; a failed one stops the others."""
    import torch.multiprocessing as mp  # lazy: only a multi-process check spawns

    context = mp.get_context("spawn")
    # The CPU alone computes here (megatron's fallback notices are expected).
    processes = [quiet_process(context, _spawned_rank, (rank, job), daemon=True) for rank in range(job.tp)]
    run_to_the_end(processes, what=f"check logits: of {job.tp} TP ranks, rank")


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def _compare(ours: torch.Tensor, reference: torch.Tensor, report: CheckLogitsReport) -> CheckLogitsReport:
    """Fill the report's numbers from the two [L, V] logits, over the true vocabulary."""
    vocab_size = report.vocab_size
    if ours.shape[0] != reference.shape[0] or min(ours.shape[1], reference.shape[1]) < vocab_size:
        raise RuntimeError(f"check logits: loongforge gave logits {list(ours.shape)}, transformers "
                           f"{list(reference.shape)}, for {report.tokens} tokens of a {vocab_size} vocabulary")
    ours, reference = ours[:, :vocab_size].double(), reference[:, :vocab_size].double()
    difference = (ours - reference).abs()
    report.max_abs_diff = float(difference.max())
    report.mean_abs_diff = float(difference.mean())
    report.argmax_agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    report.reference_max_abs_logit = float(reference.abs().max())
    return report
