"""ERNIE-4.5-VL's modality-isolated experts under expert parallelism: two ranks over gloo, each expert set split
over the EP group, equal transformers on a row of text and two images of other proportions (logits and the
routers' gradients) and on a row without images (no token reaches the vision experts, whose layers still run
their collectives). TP 2 with and without sequence parallelism: the TP concern (``test_tp_parity.py``) and the
training layouts (``tests/train/test_ernie4_5_vl_train.py``: TP 2 x PP 2 with sequence parallelism, Adam's
moments of the routers included)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from loongforge.config.schema import ParallelConfig
from loongforge.models.registry import get_family
from loongforge.models.hf.weights import load_hf_state_dict
from loongforge.models.media import MediaBatch

from tests.models.ernie_helpers import build_hf, sample, tiny_cfg
from tests.models.helpers import destroy_megatron, free_port, limit_threads, run_workers

LAYOUTS = {"ep2": dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)}


def _worker(rank: int, port: int, bounds: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    limit_threads()
    family = get_family("ernie4_5_vl")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    model_cfg = tiny_cfg()
    hf = build_hf(model_cfg)
    ids, rows, grids, kinds, experts = sample(((1, 4, 6), (1, 6, 2)))
    expected = hf(input_ids=ids, pixel_values=rows, image_grid_thw=grids, mm_token_type_ids=kinds,
                  moe_mm_token_type_ids=experts).logits
    expected.logsumexp(-1).mean().backward()  # a loss every position's logits reach
    expected = expected.detach()
    # The routers' gradients of the first sparse layer (transformers' [experts, hidden], as ours).
    hf_router = {kind: getattr(hf.model.language_model.layers[1].mlp, kind).gate.weight.grad
                 for kind in ("text_moe", "vision_moe")}
    positions = family.position_ids(model_cfg)(ids[0], grids, None, None)[:, None]
    # A row without images: no token reaches the vision experts, whose layers still run their collectives.
    text_ids = sample((), seed=3, text_len=16)[0]
    with torch.no_grad():
        text_expected = hf(input_ids=text_ids).logits
    for name, layout in LAYOUTS.items():
        parallel_cfg = ParallelConfig(world_size=2, **layout)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
            expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=layout.get("expert_tensor_parallel_size"))
        model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
        model = family.build(model_cfg, parallel_cfg, params_dtype=torch.float32, pre_process=True,
                             post_process=True, device="cpu").eval()
        load_hf_state_dict(model, hf.state_dict())
        logits = model(input_ids=ids, position_ids=positions, media=MediaBatch.of(pixel_values=rows,
                                                                                  image_grid_thw=grids))
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if tp_group.size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
        logits = logits[..., :300]
        logits.logsumexp(-1).mean().backward()
        error = ((logits.detach() - expected).abs().max() / expected.abs().max()).item()
        grad_error = 0.0
        for kind, reference in hf_router.items():
            grad = getattr(model.language_model.decoder.layers[1].mlp, kind).router.weight.grad.clone()
            if parallel_cfg.sequence_parallel:  # each rank routed its share of the tokens
                dist.all_reduce(grad, group=tp_group)
            grad_error = max(grad_error, ((grad - reference).abs().max() / reference.abs().max()).item())
        with torch.no_grad():
            text_logits = model(input_ids=text_ids, position_ids=torch.arange(16).expand(3, 1, 16))
            if tp_group.size() > 1:
                text_logits = gather_from_tensor_model_parallel_region(text_logits, group=tp_group)
        error = max(error, ((text_logits[..., :300] - text_expected).abs().max() / text_expected.abs().max()).item())
        if rank == 0:
            print(f"ERNIE-4.5-VL {name} vs transformers: {error:.2e} of the largest logit, routers' gradients "
                  f"{grad_error:.2e} of the largest")
        assert error < bounds[name] and grad_error < 10 * bounds[name], (name, error, grad_error)
        parallel_state.destroy_model_parallel()
    destroy_megatron()


def test_ep2_equals_transformers():
    run_workers(_worker, 2, (free_port(), {"ep2": 2e-6}), 300)
