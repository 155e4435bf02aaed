"""Tensor parallel size 2 over gloo (two spawned processes), without and with sequence parallelism, gives
transformers' Qwen3.5 (and Qwen3.5-MoE) logits and losses on text, an image, two images, a video and a packed row of three
samples; each rank holds whole key-head groups of every Gated DeltaNet layer, a distributed checkpoint
records the TP-independent whole shapes (so it reshards), and both ranks' shards convert back to the
transformers weights bit for bit."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.config.schema import ParallelConfig
from loongforge.models.qwen3_5.hf_mapping import to_hub_style
from tests.models.helpers import destroy_megatron, free_port, init_megatron, limit_threads, run_workers
from tests.models.test_qwen3_5_parity import build_hf_model, relative, tiny_model_cfg
from tests.models.test_qwen3_vl_support import hf_logits, hf_position_ids, make_sample, our_inputs

TOLERANCE = 1e-5  # of the largest logit, as at TP 1 (test_qwen3_5_parity)
WORLD_SIZE = 2
TIMEOUT_S = 300
LAYOUTS = {
    "text": dict(),
    "one_image": dict(images=((1, 8, 12),)),
    "two_images": dict(images=((1, 8, 12), (1, 6, 4))),
    "video": dict(videos=((3, 4, 6),)),
}
# Whole shapes a checkpoint records for a linear-attention layer (layer 0) and the gated attention (layer 3):
# the projection's 2 key-head groups of [q 32, k 32, v 2x32, z 2x32, b 2, a 2] rows, the convolution's
# groups of [q, k, v] channels, one decay per value head; the gated qkv: 2 groups of [2 q, 2 gates, k, v].
SHARDED_SHAPES = {
    "language_model.decoder.layers.0.self_attention.in_proj.weight": (2 * (32 + 32 + 64 + 64 + 2 + 2), 128),
    "language_model.decoder.layers.0.self_attention.conv1d.weight": (2 * (32 + 32 + 64), 1, 4),
    "language_model.decoder.layers.0.self_attention.A_log": (4,),
    "language_model.decoder.layers.0.self_attention.out_proj.weight": (128, 128),
    "language_model.decoder.layers.3.self_attention.linear_qkv.weight": (2 * (2 + 2 + 1 + 1) * 64, 128),
}


def _worker(rank: int, port: int, workdir: str) -> None:
    from loongforge.models.hf.weights import load_hf_state_dict, megatron_to_hf
    from loongforge.models.qwen3_5.model import build_model

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for sequence_parallel in (False, True):
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, sequence_parallel=sequence_parallel,
                                      world_size=WORLD_SIZE)
        model = build_model(data["model_cfg"], parallel_cfg, params_dtype=torch.float32, pre_process=True,
                            post_process=True, device="cpu").eval()
        load_hf_state_dict(model, data["hf_state"])
        if not sequence_parallel:
            shards = [None] * WORLD_SIZE
            dist.all_gather_object(shards, model.state_dict())
            results["written"] = megatron_to_hf(shards, data["model_cfg"])
            sharded = model.sharded_state_dict()
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


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_with_and_without_sequence_parallelism_matches_transformers(tmp_path, kind):
    """Qwen3.5-MoE's experts split over TP like the dense MLP (expert TP = TP), its shared expert too."""
    model_cfg = tiny_model_cfg(moe=kind == "moe")
    hf_model = build_hf_model(model_cfg)
    samples = {name: _even_length_sample(model_cfg, **layout) for name, layout in LAYOUTS.items()}
    references = {name: hf_logits(hf_model, s) for name, s in samples.items()}
    cases = {name: our_inputs(s, hf_position_ids(hf_model, s)) for name, s in samples.items()}
    packed = [samples["two_images"], samples["video"], samples["text"]]
    lengths = [s.input_ids.shape[1] for s in packed]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    cases["packed"] = dict(
        input_ids=torch.cat([s.input_ids for s in packed], dim=1),
        position_ids=torch.cat([cases[name]["position_ids"] for name in ("two_images", "video", "text")], dim=2),
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)),
        pixel_values=packed[0].pixel_values, image_grid_thw=packed[0].image_grid_thw,
        pixel_values_videos=packed[1].pixel_values_videos, video_grid_thw=packed[1].video_grid_thw,
    )
    references["packed"] = torch.cat([references[name] for name in ("two_images", "video", "text")], dim=1)
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
    expected = to_hub_style(hf_model.state_dict())  # the MoE's experts one tensor each, as the Hub keeps them
    expected.pop("lm_head.weight")  # tied
    assert results["written"].keys() == expected.keys()
    assert all(torch.equal(results["written"][key], expected[key]) for key in expected)
    worst = 0.0
    for name, reference in references.items():
        picked = loss_masks[name][0].bool()
        reference_loss = F.cross_entropy(reference[0][picked], labels[name][0][picked], reduction="none")
        for sequence_parallel in (False, True):
            logits, loss = results[sequence_parallel, name]
            worst = max(worst, relative(logits, reference))
            assert relative(logits, reference) <= TOLERANCE, (name, sequence_parallel)
            assert (loss[0][~picked] == 0).all(), (name, sequence_parallel)
            assert relative(loss[0][picked], reference_loss) <= TOLERANCE, (name, sequence_parallel)
    print(f"\nqwen3.5 {kind} TP 2 (and + SP) vs transformers: logits within {worst:.1e} of the largest")
