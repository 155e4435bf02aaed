"""Tensor parallel size 2 over gloo (two spawned processes) gives transformers' logits and loss.

Both vision TP layouts are checked in one launch: vision TP = language TP (2) and vision TP = 1.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongforge.config.schema import ParallelConfig
from tests.models.helpers import (
    build_hf_model,
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
WORLD_SIZE = 2
TIMEOUT_S = 240
VISION_TP_SIZES = (None, 1)  # None: same as the language model


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.qwen2_5_vl.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for vision_tp in VISION_TP_SIZES:
        parallel_cfg = ParallelConfig(
            tensor_model_parallel_size=WORLD_SIZE, vision_tensor_model_parallel_size=vision_tp, world_size=WORLD_SIZE
        )
        model = build_model(
            data["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True, post_process=True,
            device="cpu",
        ).eval()
        load_hf_state_dict(model, data["hf_state"])
        results[vision_tp, "vision_tp_size"] = model.vision_model.layers[0].pg_collection.tp.size()
        results[vision_tp, "vision_weight_is_tp"] = model.vision_model.layers[0].mlp.linear_fc1.weight.tensor_model_parallel
        for name, inputs in data["cases"].items():
            with torch.no_grad():
                logits = model(**inputs)  # [1, s, V/2]
                loss = model(**inputs, labels=data["labels"][name])
            shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
            dist.all_gather(shards, logits.contiguous())
            results[vision_tp, name] = (torch.cat(shards, dim=-1), loss)
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def test_tp2_matches_transformers(tmp_path):
    model_cfg = tiny_model_cfg(tie=False)
    hf_model = build_hf_model(model_cfg)
    layouts = {"text": {}, "two_images": dict(images=((1, 8, 12), (1, 20, 16))), "video": dict(videos=((2, 8, 8),))}
    samples = {name: make_sample(model_cfg, **layout) for name, layout in layouts.items()}
    cases = {name: our_inputs(s, hf_position_ids(hf_model, s)) for name, s in samples.items()}
    labels = {name: torch.randint(0, model_cfg.language.vocab_size, s.input_ids.shape) for name, s in samples.items()}
    torch.save(
        dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), cases=cases, labels=labels), tmp_path / "inputs.pt"
    )

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    results = torch.load(tmp_path / "outputs.pt", weights_only=False)
    assert results[None, "vision_tp_size"] == 2 and results[1, "vision_tp_size"] == 1
    assert results[None, "vision_weight_is_tp"] and not results[1, "vision_weight_is_tp"]
    for name, sample in samples.items():
        reference = hf_logits(hf_model, sample)
        reference_loss = F.cross_entropy(reference[0], labels[name][0], reduction="none")
        for vision_tp in VISION_TP_SIZES:
            logits, loss = results[vision_tp, name]
            assert (logits - reference).abs().max() <= TOLERANCE, (name, vision_tp)
            assert (loss[0] - reference_loss).abs().max() <= TOLERANCE, (name, vision_tp)
