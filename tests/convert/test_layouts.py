"""Round trip through a real layout: HF -> ``convert --to mcore`` -> loaded by 4 gloo ranks at TP=2,
PP=2, vision TP=1 -> saved by those ranks with dist_checkpointing (as ``loongforge train`` does) ->
``convert --to hf``: every tensor bit-identical, identical key set. Also through an interleaved,
uneven pipeline (2 ranks, PP 2 x VP 2, ``Et|tt|tt|tL``), saved by the trainer's own checkpoint code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from loongforge.config.schema import ParallelConfig
from tests.convert.helpers import hub_state, invoke, save_hf_checkpoint
from tests.models.helpers import (
    destroy_megatron,
    free_port,
    init_megatron,
    limit_threads,
    run_workers,
    tiny_model_cfg,
)

WORLD_SIZE, TP, PP = 4, 2, 2


def _worker(rank: int, port: int, workdir: str, model_cfg) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    from loongforge.models.qwen2_5_vl.model import build_model
    from loongforge.train.checkpoint import load_checkpoint

    limit_threads()
    init_megatron(rank, WORLD_SIZE, port, tp=TP, pp=PP)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    parallel_cfg = ParallelConfig(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                                  vision_tensor_model_parallel_size=1, world_size=WORLD_SIZE)
    model = build_model(model_cfg, parallel_cfg, params_dtype=torch.float32, pre_process=first,
                        post_process=last, device="cpu")
    with torch.no_grad():  # make sure every loaded value comes from the checkpoint
        for param in model.parameters():
            param.fill_(float("nan"))
    load_checkpoint(Path(workdir) / "mcore", [model], optimizer=None, scheduler=None)
    out = Path(workdir) / "trained" / "step_00000000"
    # vision TP 1 under language TP 2: the model itself marks the towers' replicas
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "model_optim"))
    if rank == 0:
        (out / "meta.json").write_text(json.dumps({"step": 0, "layout": {"tp": TP, "pp": PP}}))
    destroy_megatron()


def test_hf_to_tp2_pp2_to_hf_is_bit_exact(tmp_path):
    model_cfg = tiny_model_cfg(tie=False)
    save_hf_checkpoint(tmp_path / "hf", model_cfg, style="hub")
    assert invoke(str(tmp_path / "hf"), str(tmp_path / "mcore"), "--to", "mcore", "--tp", "2", "--pp", "2",
                  "--vision-tp", "1").exit_code == 0
    (tmp_path / "trained" / "step_00000000" / "model_optim").mkdir(parents=True)
    run_workers(_worker, WORLD_SIZE, (free_port(), str(tmp_path), model_cfg), timeout_s=300)
    # the model config comes with the HF files of the converted checkpoint
    shutil.copytree(tmp_path / "mcore" / "hf", tmp_path / "trained" / "step_00000000" / "hf")
    result = invoke(str(tmp_path / "trained" / "step_00000000"), str(tmp_path / "back"), "--to", "hf")
    assert result.exit_code == 0, result.output
    original, back = hub_state(tmp_path / "hf"), hub_state(tmp_path / "back")
    assert original.keys() == back.keys()
    different = [k for k in original if not torch.equal(original[k], back[k])]
    assert not different, different


LAYOUT = "Et|tt|tt|tL"


def _interleaved_worker(rank: int, port: int, workdir: str, model_cfg) -> None:
    from loongforge.config.pipeline_layout import megatron_virtual_stages
    from loongforge.models.qwen2_5_vl.model import build_model
    from loongforge.train.checkpoint import _sharded_state, load_checkpoint
    from megatron.core import dist_checkpointing, parallel_state

    limit_threads()
    parallel_cfg = ParallelConfig(pipeline_model_parallel_size=2, pipeline_layout=LAYOUT, world_size=2)
    init_megatron(rank, 2, port, pp=2, vp=megatron_virtual_stages(parallel_cfg))
    chunks = [build_model(model_cfg, parallel_cfg, params_dtype=torch.float32,
                          pre_process=parallel_state.is_pipeline_first_stage() and stage == 0,
                          post_process=parallel_state.is_pipeline_last_stage() and stage == 1,
                          device="cpu", vp_stage=stage) for stage in (0, 1)]
    with torch.no_grad():  # make sure every loaded value comes from the checkpoint
        for param in (param for chunk in chunks for param in chunk.parameters()):
            param.fill_(float("nan"))
    load_checkpoint(Path(workdir) / "mcore", chunks, optimizer=None, scheduler=None)
    out = Path(workdir) / "trained" / "step_00000000"
    dist_checkpointing.save(_sharded_state(chunks, None, is_loading=False), str(out / "model_optim"))
    if rank == 0:
        (out / "meta.json").write_text(json.dumps({"step": 0, "layout": {"tp": 1, "pp": 2, "vp": 2}}))
    destroy_megatron()


def test_hf_to_an_uneven_pp2_x_vp2_layout_to_hf_is_bit_exact(tmp_path):
    model_cfg = tiny_model_cfg(tie=False, num_layers=6)
    save_hf_checkpoint(tmp_path / "hf", model_cfg, style="hub")
    assert invoke(str(tmp_path / "hf"), str(tmp_path / "mcore"), "--to", "mcore", "--pp", "2",
                  "--pipeline-layout", LAYOUT).exit_code == 0
    wrong = invoke(str(tmp_path / "hf"), str(tmp_path / "wrong"), "--to", "mcore", "--pp", "2",
                   "--pipeline-layout", "Et|tt|tL")
    assert wrong.exit_code == 2 and "--pipeline-layout='Et|tt|tL' has 3 stages" in wrong.output
    (tmp_path / "trained" / "step_00000000" / "model_optim").mkdir(parents=True)
    run_workers(_interleaved_worker, 2, (free_port(), str(tmp_path), model_cfg), timeout_s=300)
    shutil.copytree(tmp_path / "mcore" / "hf", tmp_path / "trained" / "step_00000000" / "hf")
    result = invoke(str(tmp_path / "trained" / "step_00000000"), str(tmp_path / "back"), "--to", "hf")
    assert result.exit_code == 0, result.output
    original, back = hub_state(tmp_path / "hf"), hub_state(tmp_path / "back")
    assert original.keys() == back.keys()
    different = [k for k in original if not torch.equal(original[k], back[k])]
    assert not different, different
