"""Pipeline parallel size 2 (two spawned gloo processes), tied embeddings: stage 0 holds the vision
tower, embeddings and layer 0; stage 1 holds layer 1, the final norm and a copy of the tied output
weight. Hidden states passed between stages by hand give transformers' logits."""

from pathlib import Path

import torch
import torch.distributed as dist

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


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict
    from loongforge.models.qwen2_5_vl.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, pp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    first, last = rank == 0, rank == WORLD_SIZE - 1
    model = build_model(
        data["model_cfg"], ParallelConfig(pipeline_model_parallel_size=WORLD_SIZE, world_size=WORLD_SIZE),
        params_dtype=torch.float32, pre_process=first, post_process=last, device="cpu",
    ).eval()
    # Built with tied embeddings: megatron copied stage 0's embedding into stage 1's output layer.
    shared = model.shared_embedding_or_output_weight().detach().clone()
    copies = [torch.empty_like(shared) for _ in range(WORLD_SIZE)]
    dist.all_gather(copies, shared)
    load_hf_state_dict(model, data["hf_state"])
    inputs = data["inputs"]
    with torch.no_grad():
        if first:
            assert model.vision_model is not None and len(model.language_model.decoder.layers) == 1
            dist.send(model(**inputs).contiguous(), dst=1)  # [s, b, h]
        else:
            assert model.vision_model is None and model.language_model.decoder.layers[0].layer_number == 2
            seq_len = inputs["input_ids"].shape[1]
            hidden = torch.empty(seq_len, 1, data["model_cfg"].language.hidden_size)
            dist.recv(hidden, src=0)
            model.set_input_tensor(hidden)
            torch.save(
                dict(logits=model(**inputs), initial_copies_equal=torch.equal(copies[0], copies[1])),
                Path(workdir) / "outputs.pt",
            )
    destroy_megatron()


def test_pp2_matches_transformers(tmp_path):
    model_cfg = tiny_model_cfg(tie=True)
    hf_model = build_hf_model(model_cfg)
    sample = make_sample(model_cfg, images=((1, 8, 12),))
    inputs = our_inputs(sample, hf_position_ids(hf_model, sample))
    torch.save(dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), inputs=inputs), tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), timeout_s=240)

    outputs = torch.load(tmp_path / "outputs.pt", weights_only=False)
    assert outputs["initial_copies_equal"]
    assert (outputs["logits"] - hf_logits(hf_model, sample)).abs().max() <= TOLERANCE
