"""Training equals transformers (issue 31, item 5): five steps of ``loongforge train`` from an HF
folder equal five steps of the transformers model loaded from that folder, trained with torch's
AdamW on the very micro-batches the run got, with the same gradient clipping, weight-decay groups
and learning-rate schedule. Per-step loss and gradient norm to 1e-6 relative, fp32.

A path that trains the same model to a different result (a wrong loss normalisation over packed
rows, a decay group that differs, a schedule off by a step, clipping after instead of before) fails
here while every forward-parity test passes: ms-swift #7847 reports a megatron path 10 MMBench
points below the transformers path at the same settings.

The reference is independent of loongforge's model code: it reads only the run's micro-batches
(token ids, labels, loss mask, the packed row's sample boundaries, pixels and grids) and the
learning-rate formula; positions, attention per sample and the loss are transformers' and torch's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loongforge.config.loader import load_run_config
from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    SAVE_AT_END,
    SMALL_MODEL,
    grad_norms,
    losses,
    random_hf_folder,
    run_recorded,
    run_train,
    step_metric,
)

STEPS = 5
# Measured: loss 7.5e-8 / 1.1e-7, gradient norm 2.8e-7 / 7.2e-8 (Qwen2.5-VL / Qwen3), worst step; the
# issue asks 1e-5.
REL = 1e-6
LLAMAFACTORY = SHARED_DATA / "llamafactory"
# The run's optimizer and schedule, spelled out for the reference.
LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP = 1e-3, 1e-4, 2, 0.1, 1.0
BETAS, EPS = (0.9, 0.95), 1e-8
TRAINING = (f"training.train_steps={STEPS}", "training.global_batch_size=2", "training.precision=fp32",
            f"optimizer.lr={LR}", f"optimizer.min_lr={MIN_LR}", f"optimizer.weight_decay={WEIGHT_DECAY}",
            f"optimizer.clip_grad={CLIP}", f"optimizer.adam_beta1={BETAS[0]}", f"optimizer.adam_beta2={BETAS[1]}",
            f"optimizer.adam_eps={EPS}", f"schedule.warmup_steps={WARMUP}", "schedule.decay_style=cosine",
            "data.source=files", "data.read=global")
LORA = ("lora.rank=4", "lora.alpha=8")


def _alpaca_conversations(path: Path) -> Path:
    """LLaMA-Factory's alpaca demo (instruction, input, output) as chat conversations."""
    records = json.loads((LLAMAFACTORY / "alpaca_en_demo.json").read_text())[:24]
    conversations = [{"messages": [{"role": "user", "content": (r["instruction"] + "\n" + r["input"]).strip()},
                                   {"role": "assistant", "content": r["output"]}]} for r in records]
    path.write_text(json.dumps(conversations))
    return path


def scheduled_lr(step: int) -> float:
    """Linear warm-up from 0 over WARMUP steps, then cosine to MIN_LR at the last step (step from 1)."""
    if step <= WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * progress) + 1.0) * (LR - MIN_LR)


def _segments(batch: dict, image_token_id: int | None, merge_unit: int):
    """Each packed sample of a micro-batch: (token ids [1, s], labels [s], loss mask [s], its images'
    pixels or None, their grids or None)."""
    bounds = batch["cu_seqlens"].tolist()
    grids, pixels = batch["media"].grids("image"), batch["media"].rows("image")
    image, first_patch = 0, 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        ids = batch["input_ids"][0, start:end]
        if image_token_id is None or grids is None:
            yield ids[None], batch["labels"][0, start:end], batch["loss_mask"][0, start:end], None, None
            continue
        pads, taken = int((ids == image_token_id).sum()), []
        while pads > 0:
            t, h, w = grids[image].tolist()
            pads -= t * h * w // merge_unit
            taken.append(image)
            image += 1
        patches = sum(int(grids[i].prod()) for i in taken)
        yield (ids[None], batch["labels"][0, start:end], batch["loss_mask"][0, start:end],
               pixels[first_patch:first_patch + patches] if taken else None, grids[taken[0]:image] if taken else None)
        first_patch += patches


def _segment_loss_sum(model, ids, labels, mask, pixels, grids, tokens) -> torch.Tensor:
    """Summed masked cross-entropy of one sample under transformers' own positions."""
    kwargs = {}
    if tokens is not None:  # a vision-language model: M-RoPE positions from transformers' get_rope_index
        types = (ids == tokens.image_token_id).long() + 2 * (ids == tokens.video_token_id).long()
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT's wrapper
        kwargs["position_ids"], _ = hf_model.model.get_rope_index(ids, types, image_grid_thw=grids, video_grid_thw=None)
        kwargs.update(pixel_values=pixels, image_grid_thw=grids)
    logits = model(input_ids=ids, **kwargs).logits[0]  # [s, V]
    per_token = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    return (per_token * mask).sum()


def _clip_by_global_norm(model, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` rule (scale by max_norm / (norm + 1e-6) when below 1) with the norm
    summed in float64: fp32 sums of this model's squared gradients are off by 3e-5 relative."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for grad in grads:
            grad.mul_(factor)
    return norm


def _reference(folder: Path, batches_dir: Path, tokens, merge_unit: int,
               adapters: Path | None = None) -> tuple[list[float], list[float]]:
    """(loss, gradient norm before clipping) per step of transformers + torch AdamW; with ``adapters``
    (a PEFT folder: the run's initial adapters), transformers + PEFT training those alone."""
    import transformers

    model = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0]) \
        .from_pretrained(folder, dtype=torch.float32)
    if adapters is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapters, is_trainable=True)
    model.train()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decayed = [p for n, p in trained if p.ndim > 1 and not n.endswith(".bias")]
    kept = [p for n, p in trained if p.ndim <= 1 or n.endswith(".bias")]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": WEIGHT_DECAY},
                                   {"params": kept, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS)
    step_losses, norms = [], []
    for step in range(1, STEPS + 1):
        batches = torch.load(batches_dir / f"step{step}.pt", weights_only=False)
        loss_tokens = sum(float(b["loss_mask"].sum()) for b in batches)
        loss_sum = torch.zeros(())
        for batch in batches:
            for segment in _segments(batch, tokens.image_token_id if tokens is not None else None, merge_unit):
                loss_sum = loss_sum + _segment_loss_sum(model, *segment, tokens)
        (loss_sum / loss_tokens).backward()
        norms.append(_clip_by_global_norm(model, CLIP))
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(step)
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(float(loss_sum) / loss_tokens)
    return step_losses, norms


def _initial_adapters(run_options: list[str], folder: Path, preset: str) -> Path:
    """The adapters a LoRA run starts from, as a PEFT folder: one step at learning rate 0 (nothing
    moves) from the same seed, exported with ``convert --adapter``."""
    from typer.testing import CliRunner

    from loongforge.cli.app import app

    initial = folder.parent / "initial_run"
    run_train(initial, *run_options, "training.train_steps=1", "optimizer.lr=0", "optimizer.min_lr=0", SAVE_AT_END,
              preset=preset)
    result = CliRunner().invoke(app, ["convert", str(initial / "checkpoints"), str(folder), "--to", "hf", "--adapter",
                                      "--no-progress"])
    assert result.exit_code == 0, result.output
    return folder


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("preset", ["qwen2.5vl-tiny-small-vocab", "llm-tiny-small-vocab"])
def test_five_steps_equal_transformers_with_adamw(tmp_path, preset, lora):
    """Full fine-tuning against transformers; LoRA (rank 4 on the language model) against
    transformers + PEFT, from the run's own initial adapters."""
    vision = preset.startswith("qwen2.5vl")
    data = LLAMAFACTORY / "mllm_demo.json" if vision else _alpaca_conversations(tmp_path / "alpaca.json")
    options = [*SMALL_MODEL, *TRAINING, f"data.paths=[{data}]"]
    folder, run = tmp_path / "hf", tmp_path / "run"
    random_hf_folder(preset, options, folder)
    run_options = [*TRAINING, f"data.paths=[{data}]", f"checkpoint.load_hf={folder}", *(LORA if lora else ())]
    adapters = _initial_adapters(run_options, tmp_path / "initial_adapters", preset) if lora else None
    run_recorded(run, *run_options, nproc=1, preset=preset, record_batches=True)
    assert step_metric(run, "lr") == pytest.approx([scheduled_lr(s) for s in range(1, STEPS + 1)], rel=1e-12)
    model_cfg = load_run_config(preset, overrides=options).model
    tokens = model_cfg.tokens if vision else None
    merge_unit = model_cfg.projector.spatial_merge_size ** 2 if vision else 1
    want_losses, want_norms = _reference(folder, run / "batches_rank0", tokens, merge_unit, adapters)
    got_losses, got_norms = losses(run), grad_norms(run)
    worst = {what: max(abs(a - e) / abs(e) for a, e in zip(got, want))
             for what, got, want in (("loss", got_losses, want_losses), ("grad_norm", got_norms, want_norms))}
    print(f"{preset}{' LoRA' if lora else ''}: losses {got_losses} vs transformers {want_losses}; grad norms "
          f"{got_norms} vs {want_norms}; worst relative {worst}")
    assert min(want_norms) > (0.0 if lora else CLIP)  # full: clipping active in every step
    assert got_losses[-1] < got_losses[0]
    assert worst["loss"] <= REL and worst["grad_norm"] <= REL, worst
