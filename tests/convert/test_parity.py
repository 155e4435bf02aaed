"""Logits parity: tiny transformers checkpoints -> ``loongforge convert --to mcore`` -> loaded into the
loongforge model (TP=1 in-process, TP=2 over gloo with vision TP=1) give transformers' logits and loss.

Cases: text only, one image, two images of different sizes, a video. GQA (4 heads, 2 groups), one
windowed and one full-attention vision block, tied and untied embeddings, both HF key styles.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from loongforge.convert.engine import hf_to_mcore
from tests.convert.helpers import save_hf_checkpoint
from tests.models.helpers import (
    destroy_megatron,
    free_port,
    hf_logits,
    hf_position_ids,
    init_megatron,
    limit_threads,
    make_sample,
    our_inputs,
    run_workers,
    tiny_model_cfg,
)

TOLERANCE = 1e-5
CASES = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),
    "two_images": dict(images=((1, 8, 12), (1, 20, 16))),
    "video": dict(videos=((2, 8, 8),)),
}


def _convert(tmp_path: Path, tie: bool, style: str, tp: int = 1):
    model_cfg = tiny_model_cfg(tie=tie)
    assert model_cfg.language.num_query_groups < model_cfg.language.num_attention_heads
    assert model_cfg.vision.window.fullatt_block_indexes == [1] and model_cfg.vision.depth == 2
    hf_model = save_hf_checkpoint(tmp_path / "hf", model_cfg, style=style)
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=tp, progress=False)
    return model_cfg, hf_model


def _inputs(model_cfg, hf_model):
    samples = {name: make_sample(model_cfg, **layout) for name, layout in CASES.items()}
    inputs = {name: our_inputs(s, hf_position_ids(hf_model, s)) for name, s in samples.items()}
    generator = torch.Generator().manual_seed(1)
    labels = {name: torch.randint(0, model_cfg.language.vocab_size, s.input_ids.shape, generator=generator)
              for name, s in samples.items()}
    return samples, inputs, labels


def _build_and_load(model_cfg, parallel_cfg, folder: Path):
    from loongforge.models.qwen2_5_vl.model import build_model
    from loongforge.train.checkpoint import load_checkpoint

    model = build_model(model_cfg, parallel_cfg, params_dtype=torch.float32, pre_process=True,
                        post_process=True, device="cpu").eval()
    state = load_checkpoint(folder, [model], optimizer=None, scheduler=None)
    assert state.step == 0 and state.data_state is None
    return model


def _max_diffs(logits, loss, reference, labels):
    reference_loss = F.cross_entropy(reference[0], labels[0], reduction="none")
    return (logits - reference).abs().max().item(), (loss[0] - reference_loss).abs().max().item()


@pytest.mark.parametrize("tie, style", [(True, "new"), (False, "hub"), (True, "hub"), (False, "new")],
                         ids=["tied-new_keys", "untied-hub_keys", "tied-hub_keys", "untied-new_keys"])
def test_tp1_logits_match_transformers(megatron_world_of_one, tmp_path, tie, style):
    model_cfg, hf_model = _convert(tmp_path, tie, style)
    model = _build_and_load(model_cfg, ParallelConfig(), tmp_path / "mcore")
    samples, inputs, labels = _inputs(model_cfg, hf_model)
    for name in CASES:
        with torch.no_grad():
            logits, loss = model(**inputs[name]), model(**inputs[name], labels=labels[name])
        logits_diff, loss_diff = _max_diffs(logits, loss, hf_logits(hf_model, samples[name]), labels[name])
        print(f"parity tp=1 {tie=} {style=} {name}: logits {logits_diff:.2e} loss {loss_diff:.2e}")
        assert logits_diff <= TOLERANCE and loss_diff <= TOLERANCE, name


WORLD_SIZE = 2


def _tp2_worker(rank: int, port: int, workdir: str) -> None:
    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, vision_tensor_model_parallel_size=1,
                                  world_size=WORLD_SIZE)
    model = _build_and_load(data["model_cfg"], parallel_cfg, Path(workdir) / "mcore")
    results = {}
    for name, inputs in data["inputs"].items():
        with torch.no_grad():
            logits = model(**inputs)  # [1, s, V/2]
            loss = model(**inputs, labels=data["labels"][name])
        shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
        dist.all_gather(shards, logits.contiguous())
        results[name] = (torch.cat(shards, dim=-1), loss)
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


@pytest.mark.parametrize("tie, style", [(False, "hub"), (True, "new")], ids=["untied-hub_keys", "tied-new_keys"])
def test_tp2_logits_match_transformers(tmp_path, tie, style):
    model_cfg, hf_model = _convert(tmp_path, tie, style, tp=2)
    samples, inputs, labels = _inputs(model_cfg, hf_model)
    torch.save(dict(model_cfg=model_cfg, inputs=inputs, labels=labels), tmp_path / "inputs.pt")
    run_workers(_tp2_worker, WORLD_SIZE, (free_port(), str(tmp_path)), timeout_s=240)
    results = torch.load(tmp_path / "outputs.pt", weights_only=False)
    for name in CASES:
        logits, loss = results[name]
        logits_diff, loss_diff = _max_diffs(logits, loss, hf_logits(hf_model, samples[name]), labels[name])
        print(f"parity tp=2 vision_tp=1 {tie=} {style=} {name}: logits {logits_diff:.2e} loss {loss_diff:.2e}")
        assert logits_diff <= TOLERANCE and loss_diff <= TOLERANCE, name
