"""``loongforge profile``: real training steps with every rank's micro-batch compute recorded.

The steps are ``train.runner.run_training``'s (same model, DDP, optimizer, schedule, data
pipeline and parallel layout); ``ProfileObserver`` only adds the timers, optionally swaps the
data for the sweep design, and writes PROFILE.jsonl. Each rank appends to its own part file as it
goes; at the end rank 0 writes the env record and the parts, in rank order, into the output.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from loongforge.calibrate.sweep import ANSWER_SHARE, SweepSource
from loongforge.config.overrides import Override
from loongforge.config.schema import RunConfig
from loongforge.profile.profile_file import PROFILE_FORMAT, write_records
from loongforge.profile.recorder import StepRecorder
from loongforge.profile.timers import cpu_clock_name
from loongforge.parallel.launch_env import needs_local_workers
from loongforge.train import launch
from loongforge.train.observer import TrainingObserver
from loongforge.train.runner import library_versions, run_training


def environment_record(cfg: RunConfig, *, env, layout, sweep: bool) -> dict:
    device = env.device
    return {
        "kind": "env", "format": PROFILE_FORMAT,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "host": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()},
        "cpu_clock": cpu_clock_name() if device.type == "cpu" else None,
        "dtype": cfg.training.precision, "preset": cfg.preset,
        "layout": {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size},
        "world_size": env.world_size, "seq_len": cfg.data.seq_len,
        "global_batch_size": cfg.training.global_batch_size,
        "data": "sweep" if sweep else (cfg.data.source, list(cfg.data.paths)),
        "model": dataclasses.asdict(cfg.model),
        "versions": library_versions(),
    }


class ProfileObserver(TrainingObserver):
    def __init__(self, output: Path, *, sweep: bool, warmup_steps: int,
                 answer_share: float = ANSWER_SHARE):
        self.output = Path(output)
        self.sweep = sweep
        self.answer_share = answer_share
        self.warmup_steps = warmup_steps
        self._recorder: Optional[StepRecorder] = None
        self._env_record: dict = {}
        self._part: Optional[Path] = None
        self._rank = 0
        self._cfg: Optional[RunConfig] = None
        self._layout = None

    def _part_path(self, rank: int) -> Path:
        return self.output.with_name(f"{self.output.name}.rank{rank:05d}.part")

    def attach(self, model_config, *, cfg, env, layout, grad_sync) -> None:
        self._cfg, self._layout, self._rank = cfg, layout, env.rank
        self._recorder = StepRecorder(model_cfg=cfg.model, rank=env.rank, layout=layout,
                                      warmup_steps=self.warmup_steps)
        self._recorder.attach(model_config, env.device, grad_sync)
        self._env_record = environment_record(cfg, env=env, layout=layout, sweep=self.sweep)
        if self.sweep:
            self._env_record["sweep_answer_share"] = self.answer_share
        self._part = self._part_path(env.rank)
        self._part.parent.mkdir(parents=True, exist_ok=True)
        self._part.write_text("")

    def data_source(self, pipeline):
        if not self.sweep:
            return pipeline
        pipeline.close()
        return SweepSource(self._cfg, dp_rank=self._layout.dp_rank, dp_size=self._layout.dp_size,
                           pad_to_multiple=pipeline.pad_to_multiple, answer_share=self.answer_share)

    def begin_step(self, step: int, micro_batches: list) -> list:
        return self._recorder.begin_step(step, micro_batches)

    def end_step(self, step: int, result, *, data_wait_s: float) -> None:
        records = self._recorder.end_step(step, result)
        records[-1]["data_wait_s"] = data_wait_s
        write_records(self._part, records)

    def close(self) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.barrier()
        if self._rank == 0:
            tmp = self.output.with_name(self.output.name + ".tmp")
            write_records(tmp, [self._env_record], append=False)
            with open(tmp, "a", encoding="utf-8") as out:
                for rank in range(world):
                    part = self._part_path(rank)
                    out.write(part.read_text(encoding="utf-8"))
                    part.unlink()
            os.replace(tmp, self.output)
        if dist.is_initialized():
            dist.barrier()


def profile_overrides(data: list[str], output: Path, steps: int) -> list:
    """Overrides that turn a training config into a profiling run writing beside ``output``.
    Built as values, not text, so paths are never reparsed as YAML."""
    run_dir = output.with_name(output.stem + ".run")
    values = {("training", "train_steps"): steps, ("training", "exit_at_step"): None,
              ("checkpoint", "save_at_end"): False, ("checkpoint", "save_interval"): 0,
              ("logging", "output_dir"): str(run_dir), ("logging", "tensorboard"): False,
              ("logging", "progress_bar"): False}
    if data:
        values[("data", "source")] = "files"
        values[("data", "paths")] = [str(Path(p)) for p in data]
    return [Override(f"profile:{'.'.join(key)}", key, delete=False, value=value)
            for key, value in values.items()]


def run_profile(cfg: RunConfig, output: Path, *, nproc_per_node: Optional[int], sweep: bool,
                warmup_steps: int, command_line: list[str], answer_share: float = ANSWER_SHARE) -> None:
    """Profile ``cfg`` into ``output`` with the process layout ``--nproc-per-node`` asks for."""
    import functools


    worker = functools.partial(profile_worker, output=str(output), sweep=sweep,
                               warmup_steps=warmup_steps, answer_share=answer_share)
    functools.update_wrapper(worker, profile_worker)  # the elastic launcher logs __name__
    if needs_local_workers(nproc_per_node):
        launch.launch_local_workers(cfg, nproc_per_node=nproc_per_node, resume=False,
                                      command_line=command_line, entrypoint=worker)
    else:
        worker(cfg, False, command_line)


def profile_worker(cfg: RunConfig, resume: bool, command_line: list[str], *, output: str,
                   sweep: bool, warmup_steps: int, answer_share: float = ANSWER_SHARE) -> None:
    """One rank of ``loongforge profile`` (module level: the spawn launcher pickles it)."""
    run_training(cfg, resume=resume, command_line=command_line,
                 observer=ProfileObserver(Path(output), sweep=sweep, warmup_steps=warmup_steps,
                                          answer_share=answer_share))
