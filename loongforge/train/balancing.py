"""The run's balancing component: the one owner of the cost model a training run prices samples with.

The model comes from ``balance.cost_model``, a checkpoint, or an online fit; the data pipeline is
handed this object once (``DataPipeline(cost_models=...)``) and reads ``cost_model`` and
``version`` itself, so a refit reaches it at the same consumed step on every rank; the model is
saved once per checkpoint (``TrainState.extra["cost_model"]``).

Precedence: an explicit ``balance.cost_model`` file, else the model saved in the checkpoint being
resumed, else an online fit: with ``balance.fit_steps = K > 0`` every rank records its
per-micro-batch compute (``StepRecorder``) for ``balance.fit_warmup_steps`` + K steps; then all
ranks gather everyone's observations and run the same NNLS fit, so every rank holds the same
model. ``balance.refit_interval = M > 0`` keeps recording and refits every M steps on the latest
K steps. A resumed run keeps the checkpoint's model instead of falling back to token counts.

A fit that the observations cannot support (e.g. every row the same length) keeps the previous
model and logs why; it never stops training.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch.distributed as dist

from loongforge.balance.cost_model import VISION_TERMS, CostModel
from loongforge.balance.fit import FitError, fit_nnls, observations_from_records
from loongforge.config.errors import InputError
from loongforge.parallel.media_assign import VisionCost
from loongforge.profile.recorder import StepRecorder
from loongforge.profile.timers import GradSyncClock

EXTRA_KEY = "cost_model"


def _all_ranks_records(records: list[dict]) -> list[dict]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return records
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return [r for part in gathered for r in part]


class RunBalancing:
    """Holds ``cost_model`` for the run (None = no model yet: planners use token counts);
    ``version`` changes whenever the model does.

    ``fit_online=False`` (a ``loongforge profile`` run, which measures on its own timers) keeps
    the file's or the checkpoint's model and never records. ``model_in_use=False`` (balancing off
    and no ``parallel.encoder_dp`` pricing media): the online fit still runs and is saved for a later
    balanced run, but its warnings about the fit's terms stay off the console of a run that does
    not price anything with it.
    """

    def __init__(self, balance_cfg, *, fit_online: bool = True, log=None, prices_vision: bool = True,
                 model_in_use: bool = True):
        self.cfg = balance_cfg
        self.fit_online = fit_online
        self.model_in_use = model_in_use
        # False when no encoder runs (data.vision_embeddings): planners see the model without its
        # vision terms, so they price what actually runs.
        self.prices_vision = prices_vision
        self._cost_model: Optional[CostModel] = None
        self.version = 0
        self.from_file = balance_cfg.cost_model is not None
        if self.from_file:
            try:
                self.cost_model = CostModel.load(balance_cfg.cost_model)
            except ValueError as exc:
                raise InputError(f"balance.cost_model: {exc}") from exc
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self._recorder: Optional[StepRecorder] = None
        self._records: list[dict] = []
        self._steps_seen = 0
        self._rank = 0
        self._clock = "wall"

    @property
    def cost_model(self) -> Optional[CostModel]:
        if self._cost_model is None or self.prices_vision:
            return self._cost_model
        return self._cost_model.without_vision()

    @cost_model.setter
    def cost_model(self, model: Optional[CostModel]) -> None:
        self._cost_model = model
        self.version += 1

    def vision_cost(self) -> VisionCost:
        """Per-image encoder cost from the model's vision terms (``parallel.encoder_dp``); P^2 + P
        while the model has none (token counts, or a fit that left them out)."""
        terms = [self.cost_model.coefficients[t] for t in VISION_TERMS] if self.cost_model else []
        return VisionCost(*terms) if any(terms) else VisionCost()

    def attach(self, model_config, *, cfg, env, layout, grad_sync: GradSyncClock) -> None:
        """Start recording for the online fit (when there is one to do)."""
        self._rank = env.rank
        # CPU time on CPU: immune to other processes sharing the cores (see profile.timers).
        self._clock = "cpu" if env.device.type == "cpu" else "wall"
        if self.fit_online and self.cfg.fit_steps > 0 and not self.from_file:
            self._recorder = StepRecorder(model_cfg=cfg.model, rank=env.rank, layout=layout,
                                          warmup_steps=self.cfg.fit_warmup_steps)
            self._recorder.attach(model_config, env.device, grad_sync)

    def _recording(self) -> bool:
        if self._recorder is None:
            return False
        if self.cost_model is None or self.cost_model.source != "fit:online":
            return True  # not fitted yet (or only a restored / default model)
        return self.cfg.refit_interval > 0

    def begin_step(self, step: int, micro_batches: list) -> list:
        if self._recording():
            return self._recorder.begin_step(step, micro_batches)
        return micro_batches

    def end_step(self, step: int, result) -> None:
        if self._recorder is None or not self._recorder.recording:
            return
        new = self._recorder.end_step(step, result)
        self._records += new
        if not new[-1]["warmup"]:
            self._steps_seen += 1
        first_fit = self._steps_seen == self.cfg.fit_steps and (
            self.cost_model is None or self.cost_model.source != "fit:online")
        refit = (self.cfg.refit_interval > 0 and self._steps_seen > self.cfg.fit_steps
                 and (self._steps_seen - self.cfg.fit_steps) % self.cfg.refit_interval == 0)
        if first_fit or refit:
            self._fit(step)

    def _fit(self, step: int) -> None:
        recorded_steps = sorted({r["step"] for r in self._records if not r["warmup"]})
        keep = set(recorded_steps[-self.cfg.fit_steps:])
        self._records = [r for r in self._records if r["step"] in keep]
        records = _all_ranks_records(self._records)  # collective: every rank calls it at this step
        try:
            obs = observations_from_records(
                [r for r in records if r["kind"] == "micro_batch"],
                [r for r in records if r["kind"] == "step"], clock=self._clock)
            result = self._fit_observations(obs)
        except FitError as exc:
            if self._rank == 0:
                self._log(f"cost model: online fit at step {step} failed, keeping "
                          f"{self.cost_model.source if self.cost_model else 'token counts'}: {exc}")
            return
        if not self.cfg.refit_interval:
            self._records = []  # fitted once: nothing will need them again
        result.model.source = "fit:online"
        result.model.environment = {"fitted_at_step": step, "steps": len(keep)}
        self.cost_model = result.model
        if self._rank == 0:
            acc = result.report["held_out_micro_batch"]
            self._log(f"cost model: fitted online at step {step} from {len(records)} records, "
                      f"held-out median error {acc.get('median_ape_pct', float('nan')):.1f}%"
                      + "".join(f"\ncost model warning: {w}" for w in result.warnings if self.model_in_use))

    def _fit_observations(self, obs):
        try:
            return fit_nnls(obs)
        except FitError as exc:
            # Real data often has one image size (or none), or one answer share: those terms
            # cannot be told apart. Image tokens still count in L and answers in L, so fit the
            # remaining terms rather than nothing.
            for exclude in (VISION_TERMS, ("n_loss",), (*VISION_TERMS, "n_loss")):
                try:
                    result = fit_nnls(obs, exclude=exclude)
                except FitError:
                    continue
                result.warnings.insert(0, f"{exc} -- fitted without {', '.join(exclude)}")
                return result
            raise

    def state_dict(self) -> dict:
        """Saved in every checkpoint (``TrainState.extra``)."""
        return {EXTRA_KEY: self._cost_model.to_dict()} if self._cost_model is not None else {}

    def load_state_dict(self, extra: dict) -> None:
        if self.from_file or EXTRA_KEY not in (extra or {}):
            return
        self.cost_model = CostModel.from_dict(extra[EXTRA_KEY], origin="checkpoint")

