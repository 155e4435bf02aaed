"""``parallel.encoder_dp=tp`` at TP 2 over gloo: the same losses and every gradient as ``none``,
with each rank encoding only its share of the media, for Qwen2.5-VL, Qwen3-VL (whose DeepStack
features travel with the merger's), InternVL's tower (tiles) and ERNIE-4.5-VL (its resampler after the
tower; images alone): the composition's sharing
(``models.vlm``), whatever the tower.

Two spawned ranks build the model twice from one init seed (``none`` and ``tp``), with and without
sequence parallelism (Qwen3-VL: with), and run forward + backward on: several images and a video in
one sample, a packed row of two samples, one image (rank 1 encodes nothing) and text only. ``tp``'s
encoder gradients are summed over the TP group (``sum_encoder_grads``, as the trainer's finalize does).
"""

from pathlib import Path

import torch
from megatron.core.packed_seq_params import PackedSeqParams

import pytest

from loongforge.config.schema import ParallelConfig
from loongforge.parallel.encoder_dp import sum_encoder_grads
from loongforge.models import parts
from loongforge.models.vlm.model import build_vlm
from tests.models import ernie_helpers as ernie
from tests.models import references
from tests.models import test_qwen3_vl_support as qwen3_vl
from tests.models.helpers import (
    cat_media,
    destroy_megatron,
    free_port,
    init_megatron,
    limit_threads,
    make_sample,
    run_workers,
    sample_media,
    tiny_model_cfg,
)

WORLD_SIZE = 2
TIMEOUT_S = 300
TOLERANCE = 1e-5


def _case(model_cfg, samples: list) -> dict:
    """One micro-batch: the samples packed into one row (an even length, for sequence parallel)."""
    input_ids = torch.cat([s.input_ids for s in samples], dim=1)
    lengths = [s.input_ids.shape[1] for s in samples]
    if input_ids.shape[1] % 2:
        input_ids = torch.cat([input_ids, torch.tensor([[11]])], dim=1)  # a text token of its own
        lengths.append(1)
    seq_len = input_ids.shape[1]
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        input_ids=input_ids,
        position_ids=torch.arange(seq_len).expand(3, 1, seq_len).contiguous(),
        labels=torch.randint(0, model_cfg.language.vocab_size, (1, seq_len),
                             generator=torch.Generator().manual_seed(seq_len)),
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)),
        media=cat_media([sample_media(s) for s in samples]),
    )


def _optional_cat(tensors: list):
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def _cases(model_cfg, make_sample=make_sample) -> dict:
    sample = lambda seed, **media: make_sample(model_cfg, seed=seed, **media)  # noqa: E731
    return {
        "images_and_video": _case(model_cfg, [sample(1, images=((1, 8, 12), (1, 20, 16), (1, 8, 8)),
                                                     videos=((2, 8, 8),))]),
        "packed": _case(model_cfg, [sample(2, images=((1, 12, 8), (1, 4, 4))), sample(3, videos=((2, 4, 8),))]),
        "one_image": _case(model_cfg, [sample(4, images=((1, 8, 8),))]),
        "text": _case(model_cfg, [sample(5)]),
    }


def _tile_cases(model_cfg) -> dict:
    """InternViT's media are tiles of one fixed grid: images of 3, 1 + 2 and 1 tiles."""
    side = references.INTERNVL_TILE // references.PATCH
    sample = lambda seed, tiles: make_sample(model_cfg, seed=seed, images=((1, side, side),) * tiles,  # noqa: E731
                                             patch_dim=3 * references.PATCH**2, text_vocab=990)
    return {"images_and_video": _case(model_cfg, [sample(1, 3)]), "packed": _case(model_cfg, [sample(2, 1), sample(3, 2)]),
            "one_image": _case(model_cfg, [sample(4, 1)]), "text": _case(model_cfg, [sample(5, 0)])}


def _ernie_cases(model_cfg) -> dict:
    """ERNIE-4.5-VL takes images alone (14-pixel patches of one temporal slot), each between its markers."""
    sample = lambda seed, *images: make_sample(model_cfg, seed=seed, images=images, patch_dim=3 * 14 * 14,  # noqa: E731
                                               text_vocab=280)
    return {"images_and_video": _case(model_cfg, [sample(1, (1, 8, 12), (1, 20, 16), (1, 8, 8))]),
            "packed": _case(model_cfg, [sample(2, (1, 12, 8), (1, 4, 4)), sample(3, (1, 4, 8))]),
            "one_image": _case(model_cfg, [sample(4, (1, 8, 8))]), "text": _case(model_cfg, [sample(5)])}


def _run(model, cases: dict, shared: bool) -> dict:
    """Per case: loss [1, s], every parameter's gradient, and the patches this rank encoded."""
    encoded = []
    hook = model.vision_model.register_forward_pre_hook(
        lambda module, args: encoded.append(int(args[1].prod(-1).sum())))
    results = {}
    for name, inputs in cases.items():
        encoded.clear()
        loss = model(**inputs)
        loss.sum().backward()
        if shared:
            sum_encoder_grads([model])
        grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        results[name] = dict(loss=loss.detach(), grads=grads, encoded=sum(encoded))
    hook.remove()
    return results


# family -> (the sequence-parallel settings it runs, its tiny config, its sample maker)
FAMILIES = {
    "qwen2_5_vl": ((False, True), lambda: tiny_model_cfg(tie=False), _cases),
    "qwen3_vl": ((True,), qwen3_vl.tiny_model_cfg, lambda cfg: _cases(cfg, qwen3_vl.make_sample)),
    # InternVL3.5 (its tiny reference config, tests/models/references.py): tiles, 1-D RoPE.
    "intern_vit": ((True,), references.internvl_model_cfg, _tile_cases),
    "llava_onevision1_5": ((True,), references.llava_onevision1_5_model_cfg,
                           lambda cfg: _cases(cfg, lambda *a, **k: make_sample(*a, patch_dim=3 * 14 * 14, **k))),
    # ERNIE-4.5-VL: the resampler after the tower, modality-isolated experts (which train under TP with sequence
    # parallelism only).
    "ernie4_5_vl": ((True,), ernie.tiny_cfg, _ernie_cases),
}


def _build(family: str, model_cfg, parallel_cfg):
    from loongforge.models.registry import get_family

    options = dict(params_dtype=torch.float32, pre_process=True, post_process=True, device="cpu", init_seed=7)
    if family == "intern_vit":
        return build_vlm(model_cfg, parallel_cfg, parts.tower("intern_vit"), side_sets=0, merge_unit=4, rope="rope",
                         **options)
    vision = {"vision": qwen3_vl.TINY_VISION} if family == "qwen3_vl" else {}
    return get_family(family).build(model_cfg, parallel_cfg, **options, **vision)


def _worker(rank: int, port: int, workdir: str, family: str) -> None:
    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=WORLD_SIZE)
    data = torch.load(Path(workdir) / "inputs.pt", weights_only=False)
    results = {}
    for sequence_parallel in FAMILIES[family][0]:
        for mode in ("none", "tp"):
            parallel_cfg = ParallelConfig(tensor_model_parallel_size=WORLD_SIZE, vision_tensor_model_parallel_size=1,
                                          sequence_parallel=sequence_parallel, encoder_dp=mode, world_size=WORLD_SIZE)
            model = _build(family, data["model_cfg"], parallel_cfg)
            assert (model.shared_encoding is not None) == (mode == "tp")
            results[sequence_parallel, mode] = _run(model, data["cases"], shared=mode == "tp")
    torch.save(results, Path(workdir) / f"outputs_{rank}.pt")
    destroy_megatron()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """The largest difference relative to the largest expected value (asserted within TOLERANCE)."""
    relative = float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    assert relative <= TOLERANCE, (what, relative)
    return relative


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp_shares_the_encoder_and_matches_none(tmp_path, family):
    sequence_parallel_settings, model_cfg, cases = FAMILIES[family]
    model_cfg = model_cfg()
    cases = cases(model_cfg)
    torch.save(dict(model_cfg=model_cfg, cases=cases), tmp_path / "inputs.pt")

    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path), family), TIMEOUT_S)

    ranks = [torch.load(tmp_path / f"outputs_{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    worst = 0.0
    for sequence_parallel in sequence_parallel_settings:
        for name, inputs in cases.items():
            grids = _optional_cat([inputs["media"].grids("image"), inputs["media"].grids("video")])
            total = 0 if grids is None else int(grids.prod(-1).sum())
            # none: every rank encodes every patch; tp: the ranks' shares add up to them.
            encoded = [rank[sequence_parallel, "tp"][name]["encoded"] for rank in ranks]
            assert sum(encoded) == total, (name, encoded)
            assert all(rank[sequence_parallel, "none"][name]["encoded"] == total for rank in ranks), name
            if name == "images_and_video":
                assert min(encoded) > 0  # both ranks did a share
            for rank in ranks:
                none, tp = rank[sequence_parallel, "none"][name], rank[sequence_parallel, "tp"][name]
                worst = max(worst, _assert_close(tp["loss"], none["loss"], f"{name} loss (sp={sequence_parallel})"))
                for param, grad in none["grads"].items():
                    worst = max(worst, _assert_close(tp["grads"][param], grad,
                                                     f"{name} grad {param} (sp={sequence_parallel})"))
    print(f"{family}: encoder_dp=tp vs none, worst relative difference of a loss or gradient {worst:.1e}")
    last, one_image = sequence_parallel_settings[-1], int(cases["one_image"]["media"].grids("image").prod())
    assert [ranks[r][last, "tp"]["one_image"]["encoded"] for r in range(WORLD_SIZE)] == [one_image, 0]
