"""Expert parallelism equal to transformers, every reference with routed experts (``EP_REFERENCES``): ONE launch of
two ranks that loops over them. Each rank feeds a text sample of its own (seed = its rank) through the model with its
experts split over EP 2 (half of each layer's on each rank, its tokens reaching the other half by all-to-all), and
its logits are compared with transformers' on the same sample. The same launch then builds Qwen2-MoE (3 of its 6
experts on each rank, a gated shared expert) with grouped and with sequential experts (``GROUPED_REFERENCE``) and
compares their logits and every gradient, and once more with its shared expert not overlapped with the all-to-all
(``parallel.moe_shared_expert_overlap: false``; on by default at EP > 1) to prove the overlap changes no number."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loongforge.config.schema import ParallelConfig
from loongforge.models.hf.weights import load_hf_state_dict
from tests.models.helpers import destroy_megatron, free_port, limit_threads, run_workers
from tests.models.references import REFERENCES, reference_logits
from tests.models.test_grouped_experts import BOUND, gradients, with_experts, worst_difference

EP_WORLD = 2
# The references whose experts split over EP (the text family's MoE architectures and the vision MoE families);
# ERNIE-4.5-VL's two expert sets have their EP 2 proof in tests/models/test_ernie4_5_vl_parallel.py.
EP_REFERENCES = [name for name, reference in REFERENCES.items()
                 if reference.model_cfg().language.moe is not None and name != "ernie4_5_vl"]
TOLERANCE = 1e-5
GROUPED_REFERENCE = "qwen2_moe"


def _worker(rank: int, port: int, workdir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP_WORLD,
                            timeout=timedelta(seconds=120))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP_WORLD)
    lines = []
    for name in EP_REFERENCES:
        model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
        reference = REFERENCES[name]
        model_cfg = reference.model_cfg()
        hf_model = reference.hf_model(model_cfg)
        model = reference.build(model_cfg, ParallelConfig(expert_model_parallel_size=EP_WORLD,
                                                          world_size=EP_WORLD)).eval()
        load_hf_state_dict(model, hf_model.state_dict())
        case = reference.sample(model_cfg, hf_model, seed=rank)
        with torch.no_grad():
            ours = model(**case.ours)[..., :model_cfg.language.vocab_size]
        expected = reference_logits(hf_model, case)
        scale = float(expected.abs().max()) if reference.relative else 1.0
        lines.append(f"{name} {float((ours - expected).abs().max()) / scale}")
    lines += _grouped_against_sequential(rank)
    (Path(workdir) / f"rank{rank}.txt").write_text("\n".join(lines))
    destroy_megatron()


def _grouped_against_sequential(rank: int) -> list[str]:
    """Lines ``grouped_logits`` / ``grouped_gradients``: the largest differences of this rank's logits and
    gradients (its experts', the replicated rest's) between grouped and sequential experts at EP 2; lines
    ``overlap_logits`` / ``overlap_gradients``: the same between sequential experts with the shared expert overlapped
    with the dispatch (the default) and without."""
    reference = REFERENCES[GROUPED_REFERENCE]
    hf_model = reference.hf_model(reference.model_cfg())
    logits, grads, overlapped = {}, {}, {}
    for experts, overlap in (("sequential", True), ("grouped", True), ("no_overlap", False)):
        model_cfg = with_experts(reference.model_cfg(), "sequential" if experts == "no_overlap" else experts)
        model = reference.build(model_cfg, ParallelConfig(expert_model_parallel_size=EP_WORLD, world_size=EP_WORLD,
                                                          moe_shared_expert_overlap=overlap))
        overlapped[experts] = {module.shared_expert_overlap for module in model.modules()
                               if hasattr(module, "shared_expert_overlap")}
        load_hf_state_dict(model, hf_model.state_dict())
        case = reference.sample(model_cfg, hf_model, seed=rank)
        logits[experts] = model(**case.ours)  # [1, s, V]
        weights = torch.randn(logits[experts].shape, generator=torch.Generator().manual_seed(rank))
        (logits[experts] * weights).sum().backward()
        grads[experts] = gradients(model)
    assert any(".local_experts." in name for name in grads["grouped"])
    assert overlapped == {"sequential": {True}, "grouped": {True}, "no_overlap": {False}}, overlapped
    return [f"grouped_logits {float((logits['grouped'] - logits['sequential']).abs().max())}",
            f"grouped_gradients {worst_difference(grads['grouped'], grads['sequential'])}",
            f"overlap_logits {float((logits['sequential'] - logits['no_overlap']).abs().max())}",
            f"overlap_gradients {worst_relative_difference(grads['sequential'], grads['no_overlap'])}"]


def worst_relative_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest gradient difference, each over its tensor's largest magnitude: the overlapped backward sums
    the shared and routed branches' input gradients in another order (megatron sets its autograd sequence numbers),
    fp32 rounding of gradients up to ~100 (a qkv weight's, 1.5e-5 apart)."""
    assert sorted(ours) == sorted(reference)
    return max(float((ours[k] - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1.0)) for k in reference)


@pytest.fixture(scope="module")
def differences(tmp_path_factory) -> dict[str, float]:
    workdir = tmp_path_factory.mktemp("ep2")
    run_workers(_worker, EP_WORLD, (free_port(), str(workdir)), 600)
    worst: dict[str, float] = {}
    for rank in range(EP_WORLD):
        for line in (workdir / f"rank{rank}.txt").read_text().splitlines():
            name, value = line.split()
            worst[name] = max(worst.get(name, 0.0), float(value))
    return worst


@pytest.mark.parametrize("name", EP_REFERENCES)
def test_expert_parallel_2_equals_transformers(differences, name):
    bound = REFERENCES[name].tolerance if not REFERENCES[name].relative else 3e-5
    print(f"\n{name} EP 2: logits within {differences[name]:.1e} of transformers' (asserted {bound:.0e})")
    assert differences[name] <= bound


def test_grouped_experts_equal_sequential_at_expert_parallel_2(differences):
    print(f"\n{GROUPED_REFERENCE} EP 2, grouped vs sequential experts: logits {differences['grouped_logits']:.1e}, "
          f"every gradient {differences['grouped_gradients']:.1e} (asserted {BOUND:.0e})")
    assert differences["grouped_logits"] <= BOUND and differences["grouped_gradients"] <= BOUND


def test_shared_expert_overlap_equals_no_overlap_at_expert_parallel_2(differences):
    print(f"\n{GROUPED_REFERENCE} EP 2, shared expert overlapped with the all-to-all vs after it: logits "
          f"{differences['overlap_logits']:.1e}, every gradient {differences['overlap_gradients']:.1e} of its "
          f"largest (asserted {BOUND:.0e})")
    assert differences["overlap_logits"] <= BOUND and differences["overlap_gradients"] <= BOUND
