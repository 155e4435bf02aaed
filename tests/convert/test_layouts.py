"""Round trip through a real layout: HF -> ``convert --to mcore`` -> loaded by 4 gloo ranks at TP=2,
PP=2, vision TP=1 -> saved by those ranks with dist_checkpointing (as ``loongforge train`` does) ->
``convert --to hf``: every tensor bit-identical, identical key set."""

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
