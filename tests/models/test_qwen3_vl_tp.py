"""Tensor parallel size 2 over gloo (two spawned processes) gives transformers' Qwen3-VL logits and
losses, without and with sequence parallelism (hidden states and DeepStack features [s/2, b, ...]);
the two ranks' shards convert back to the transformers weights."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.schema import ParallelConfig
from loongforge.models.qwen3_vl.hf_mapping import to_hub_style
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.test_qwen3_vl_support import (
    TINY_VISION,
    build_hf_model,
    hf_logits,
    hf_position_ids,
    make_sample,
    our_inputs,
    tiny_model_cfg,
)

TOLERANCE = 1e-5
WORLD_SIZE = 2
TIMEOUT_S = 240
LAYOUTS = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),
    "video": dict(videos=((3, 4, 6),)),
    "image_and_video": dict(images=((1, 6, 4),), videos=((2, 4, 6),)),
}
# Column-parallel weights of each tower: a checkpoint must record their whole (unsharded) shape.
SHARDED_SHAPES = {
    "vision_model.layers.0.mlp.linear_fc1.weight": (64, 32),
    "projector.mlp.linear_fc1.weight": (128, 128),
    "deepstack_projectors.1.mlp.linear_fc1.weight": (128, 128),
    # megatron stacks the decoder layers: [layers, out, in]
    "language_model.decoder.layers.0.self_attention.linear_qkv.weight": (3, 4 * 32 + 2 * 2 * 32, 64),
}


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
    from loongforge.models.qwen3_vl.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for sequence_parallel in (False, True):
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                      world_size=WORLD_SIZE)
        model = build_model(data["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                            post_process=True, device="cpu", vision=TINY_VISION).eval()
        load_hf_state_dict(model, data["hf_state"])
        if not sequence_parallel:  # both ranks' shards -> whole HF tensors again
            shards = [None] * WORLD_SIZE
            dist.all_gather_object(shards, model.state_dict())
            results["written"] = megatron_to_hf(shards, data["model_cfg"])
            sharded = model.sharded_state_dict()  # what a distributed checkpoint records
            results["global_shapes"] = {key: tuple(sharded[key].global_shape) for key in SHARDED_SHAPES}
        for name, inputs in data["cases"].items():
            with torch.no_grad():
                logits = model(**inputs)  # [1, s, V/2]
                loss = model(**inputs, labels=data["labels"][name], loss_mask=data["loss_masks"][name])
            shards = [torch.empty_like(logits) for _ in range(WORLD_SIZE)]
            dist.all_gather(shards, logits.contiguous())
            results[sequence_parallel, name] = (torch.cat(shards, dim=-1), loss)
    if rank == 0:
        torch.save(results, Path(workdir) / "outputs.pt")
    destroy_megatron()


def _even_length_sample(model_cfg, **layout):
    """Sequence parallelism splits the sequence in two: make it even."""
    sample = make_sample(model_cfg, **layout)
    return sample if sample.input_ids.shape[1] % 2 == 0 else make_sample(model_cfg, text_len=13, **layout)


def test_tp2_matches_transformers(tmp_path):
    model_cfg = tiny_model_cfg()
    hf_model = build_hf_model(model_cfg)
    samples = {name: _even_length_sample(model_cfg, **layout) for name, layout in LAYOUTS.items()}
    references = {name: hf_logits(hf_model, s) for name, s in samples.items()}
    cases = {name: our_inputs(s, hf_position_ids(hf_model, s)) for name, s in samples.items()}
    # A packed (thd) row of two samples; the references are the two separate transformers runs.
    packed = [samples["two_images"], samples["video"]]
    lengths = [s.input_ids.shape[1] for s in packed]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    cases["packed"] = dict(
        input_ids=torch.cat([s.input_ids for s in packed], dim=1),
        position_ids=torch.cat([cases["two_images"]["position_ids"], cases["video"]["position_ids"]], dim=2),
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)),
        pixel_values=packed[0].pixel_values, image_grid_thw=packed[0].image_grid_thw,
        pixel_values_videos=packed[1].pixel_values_videos, video_grid_thw=packed[1].video_grid_thw,
    )
    references["packed"] = torch.cat([references["two_images"], references["video"]], dim=1)
    generator = torch.Generator().manual_seed(3)
    shapes = {name: inputs["input_ids"].shape for name, inputs in cases.items()}
    labels = {name: torch.randint(0, model_cfg.language.vocab_size, shape, generator=generator)
              for name, shape in shapes.items()}
    loss_masks = {name: (torch.rand(shape, generator=generator) < 0.5).float() for name, shape in shapes.items()}
    torch.save(dict(model_cfg=model_cfg, hf_state=hf_model.state_dict(), cases=cases, labels=labels,
                    loss_masks=loss_masks), tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), TIMEOUT_S)

    results = torch.load(tmp_path / "outputs.pt", weights_only=False)
    assert results["global_shapes"] == SHARDED_SHAPES
    expected = to_hub_style(hf_model.state_dict())
    assert results["written"].keys() == expected.keys()
    assert all(torch.equal(results["written"][key], expected[key]) for key in expected)
    for name, reference in references.items():
        picked = loss_masks[name][0].bool()
        reference_loss = F.cross_entropy(reference[0][picked], labels[name][0][picked], reduction="none")
        for sequence_parallel in (False, True):
            logits, loss = results[sequence_parallel, name]
            assert (logits - reference).abs().max() <= TOLERANCE, (name, sequence_parallel)
            assert (loss[0][~picked] == 0).all(), (name, sequence_parallel)
            assert (loss[0][picked] - reference_loss).abs().max() <= TOLERANCE, (name, sequence_parallel)
