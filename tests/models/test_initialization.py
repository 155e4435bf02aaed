"""One seed, one initial model at every layout: TP=1 PP=1, PP=2, TP=2 (vision TP 2 and 1), tied and
untied embeddings. Two gloo ranks build each layout in turn; the pytest process joins every rank's
state dict into full HF-named tensors (``megatron_to_hf``) and compares them bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge.config.schema import ParallelConfig
from loongforge.models.layers.initialization import keyed_seed
from loongforge.models.hf.weights import megatron_to_hf
from tests.models.helpers import free_port, limit_threads, run_workers, tiny_model_cfg

WORLD_SIZE = 2
SEED = 1234
# (tp, pp, vision_tp): the first is the reference.
LAYOUTS = [(1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 1, 1)]


def _name(tp: int, pp: int, vision_tp: int, tie: bool) -> str:
    return f"tp{tp}-pp{pp}-vtp{vision_tp}-{'tied' if tie else 'untied'}"


def _worker(rank: int, port: int, workdir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from loongforge.models.qwen2_5_vl.model import build_model

    limit_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE)
    for tp, pp, vision_tp in LAYOUTS:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp)
        parallel_cfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      vision_tensor_model_parallel_size=vision_tp, world_size=WORLD_SIZE)
        for tie in (False, True):
            # A different global stream on each rank: the weights must not depend on it.
            torch.manual_seed(rank)
            model = build_model(tiny_model_cfg(tie=tie), parallel_cfg, params_dtype=torch.float32,
                                pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage(), device="cpu",
                                init_seed=SEED)
            layers = model.language_model.decoder.layers
            torch.save(dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                            dp_rank=parallel_state.get_data_parallel_rank(),
                            layer_offset=layers[0].layer_number - 1,
                            state={k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}),
                       Path(workdir) / f"{_name(tp, pp, vision_tp, tie)}-rank{rank}.pt")
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _full_model(workdir: Path, tp: int, pp: int, vision_tp: int, tie: bool) -> dict[str, torch.Tensor]:
    """HF-named full tensors of one layout, joined from its DP-rank-0 shards."""
    ranks = [torch.load(workdir / f"{_name(tp, pp, vision_tp, tie)}-rank{r}.pt", weights_only=False)
             for r in range(WORLD_SIZE)]
    full = {}
    for stage in range(pp):
        shards = sorted((r for r in ranks if r["pp_rank"] == stage and r["dp_rank"] == 0),
                        key=lambda r: r["tp_rank"])
        assert len(shards) == tp
        full.update(megatron_to_hf([r["state"] for r in shards], tiny_model_cfg(tie=tie),
                                   vision_tp_size=vision_tp, layer_offset=shards[0]["layer_offset"]))
    return full


def test_initial_weights_do_not_depend_on_the_layout(tmp_path):
    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path)), timeout_s=180)
    for tie in (False, True):
        reference = _full_model(tmp_path, *LAYOUTS[0], tie)
        assert ("lm_head.weight" in reference) != tie
        for layout in LAYOUTS[1:]:
            other = _full_model(tmp_path, *layout, tie)
            assert other.keys() == reference.keys(), _name(*layout, tie)
            different = sorted(k for k in reference if not torch.equal(reference[k], other[k]))
            assert not different, f"{_name(*layout, tie)}: {len(different)} tensors differ: {different[:6]}"
        # Not trivially equal: distinct layers and the two untied matrices got distinct draws.
        layer0, layer1 = (reference[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
        assert not torch.equal(layer0, layer1)
        if not tie:
            assert not torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])


def test_keyed_seeds_are_stable_and_distinct():
    # A stable value: sha256 based, the same in every process and Python version.
    assert keyed_seed(1, "a") == keyed_seed(1, "a")
    assert len({keyed_seed(s, k) for s in (0, 1) for k in ("a", "b")}) == 4
    assert 0 <= keyed_seed(2**40, "language_model.decoder.layers.0") < 2**63
