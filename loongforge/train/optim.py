"""megatron-core optimizer and learning-rate schedule built from our config."""

from __future__ import annotations

import torch

from loongforge.config.schema import OptimizerConfig, ScheduleConfig


def build_optimizer(model_chunks: list, optim_cfg: OptimizerConfig, *, params_dtype: torch.dtype):
    """Adam (or SGD) with fp32 main params over megatron DDP-wrapped ``model_chunks``; the
    distributed optimizer (sharding its state over DP x CP) and the overlapped param gather as the
    wrapper was built with them (``train.runner.wrap_for_training``: megatron needs both alike)."""
    ddp_config = model_chunks[0].ddp_config
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcore_cfg = McoreOptimizerConfig(
        optimizer=optim_cfg.name,
        lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr,
        weight_decay=optim_cfg.weight_decay,
        adam_beta1=optim_cfg.adam_beta1,
        adam_beta2=optim_cfg.adam_beta2,
        adam_eps=optim_cfg.adam_eps,
        clip_grad=optim_cfg.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        overlap_param_gather=ddp_config.overlap_param_gather,
    )
    return get_megatron_optimizer(mcore_cfg, model_chunks)


def build_scheduler(optimizer, optim_cfg: OptimizerConfig, schedule_cfg: ScheduleConfig,
                    *, train_steps: int):
    """Linear warm-up from 0 to lr over ``warmup_steps``, then cosine (or constant) down to min_lr."""
    # lazy: this module imports no megatron-core until a run uses it
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = min(schedule_cfg.warmup_steps, max(train_steps - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim_cfg.lr,
        min_lr=optim_cfg.min_lr if schedule_cfg.decay_style != "constant" else optim_cfg.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(train_steps, warmup + 1),
        lr_decay_style=schedule_cfg.decay_style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=max(train_steps, 1),
        wd_incr_style="constant",
    )
    # Megatron's schedule gives lr 0 at step 0; advance once so the first update already learns.
    scheduler.step(increment=1)
    return scheduler


# The schedule's settings as megatron's scheduler holds (and saves) them, each with the config key
# that sets it: what a resume compares against the checkpoint's.
SCHEDULE_SETTINGS = (
    ("max_lr", "optimizer.lr"),
    ("min_lr", "optimizer.min_lr"),
    ("lr_warmup_steps", "schedule.warmup_steps"),
    ("lr_decay_steps", "training.train_steps"),
    ("lr_decay_style", "schedule.decay_style"),
    ("start_wd", "optimizer.weight_decay"),
)


# Each parameter group of megatron's optimizer carries its own peak and minimum LR, which the scheduler
# reads before its own, and which the optimizer's load_state_dict restores from the checkpoint.
GROUP_SCHEDULE_KEYS = ("max_lr", "min_lr")


def group_schedules(optimizer) -> list[dict]:
    """Each parameter group's own schedule settings, as this run built them (taken before a
    checkpoint's optimizer state replaces them)."""
    return [{key: group[key] for key in GROUP_SCHEDULE_KEYS if key in group} for group in optimizer.param_groups]


def continue_schedule(scheduler, saved: dict, groups: list[dict]) -> list[str]:
    """Continue at the checkpoint's step under *this run's* schedule: the config is the truth.

    megatron's ``load_state_dict`` would instead replace the peak and minimum LR, warm-up and decay
    steps and weight decay with the checkpoint's, silently (and the optimizer's, each group's peak and
    minimum LR): a run extended from 6 to 12 steps then trained steps 7-12 at min_lr while its
    config.yaml said otherwise. ``groups``: ``group_schedules`` of the optimizer as built. Returns
    "key old -> new" for each setting that differs from the checkpoint's (the resume's report)."""
    changes = [f"{key} {saved[name]} -> {getattr(scheduler, name)}" for name, key in SCHEDULE_SETTINGS
               if name in saved and saved[name] != getattr(scheduler, name)]
    for group, settings in zip(scheduler.optimizer.param_groups, groups):
        group.update(settings)
    scheduler.num_steps = 0  # step() adds to it; LR and weight decay are set for the new count
    scheduler.step(increment=int(saved["num_steps"]))
    return changes
