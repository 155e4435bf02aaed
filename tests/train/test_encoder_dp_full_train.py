"""``parallel.encoder_dp=full`` end to end at TP 2 x PP 2 (4 ranks, vision TP 1) on real multimodal
data (``../shared/data/loongforge/vlm/mix.json``: text-only, one-image, two-image and video samples):
the same per-step losses, grad norms, Adam moments (sums of every gradient, language and vision)
and weights as ``none`` over 2 steps; with the distributed optimizer and overlap_grad_reduce on
micro-batches without media; with balancing re-planning packed rows; resumed from step 1 bit for
bit; checkpoints that ``none`` loads and the other way round (there with the encoder recomputed in
the backward, ``parallel.encoder_full_recompute``); and an HF export of its checkpoint.

Each 4-rank run takes about a minute on 2 cores, so the runs are shared: two module fixtures
(``none`` and ``full``, checkpoints at steps 1 and 2) and resumed copies of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from loongforge.balance.cost_model import TERMS, CostModel
from loongforge.config.loader import load_run_config
from loongforge.convert.model_io import export_hf
from loongforge.data.pipeline import DataPipeline
from tests.shared_data import SHARED_DATA
from tests.train.conftest import (
    PRESET,
    SAVE_AT_END,
    SMALL_MODEL,
    SMALL_VIDEOS,
    assert_trains_alike,
    checkpoint_differences,
    final_checkpoint,
    grad_norms,
    losses,
    resume_from_copy,
    run_train,
    step_metric,
)

RELATIVE = 1e-5
# 2 steps, resumed from step 1; the first already holds micro-batches with images, with videos and with
# neither (test_the_data_has_micro_batches_without_media).
STEPS = 2
RESUME_STEP = 1
MIX = SHARED_DATA / "loongforge" / "vlm" / "mix.json"
# seq_len 128: about one sample per row, so some micro-batches hold no image or video at all.
DATA = ("data.source=files", f"data.paths=[{MIX}]", "data.seq_len=128", *SMALL_VIDEOS)
LAYOUT = ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
          "parallel.vision_tensor_model_parallel_size=1", f"training.train_steps={STEPS}",
          "checkpoint.save_interval=1", SAVE_AT_END)
DISTRIBUTED = ("parallel.use_distributed_optimizer=true",)
OVERLAP = ("parallel.overlap_grad_reduce=true",)


def _train(out: Path, mode: str, *extra: str, resume: bool = False) -> Path:
    run_train(out, *DATA, *LAYOUT, f"parallel.encoder_dp={mode}", *extra, nproc=4, resume=resume)
    return out


def _resume_from_step_1(source: Path, out: Path, mode: str, *extra: str) -> Path:
    """A copy of ``source`` cut back to its step-1 checkpoint, resumed with ``mode``."""
    resume_from_copy(source, out, RESUME_STEP, *DATA, *LAYOUT, f"parallel.encoder_dp={mode}", *extra, nproc=4)
    return out


@pytest.fixture(scope="module")
def none_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("none"), "none")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("full"), "full", *DISTRIBUTED, *OVERLAP)


def test_the_data_has_micro_batches_without_media():
    cfg = load_run_config(PRESET, overrides=[*SMALL_MODEL, *DATA], world_size=1)
    pipeline = DataPipeline(cfg.data, cfg.model, global_batch_size=cfg.training.global_batch_size,
                            dp_rank=0, dp_size=1, pad_to_multiple=cfg.data.seq_len, pipeline_parallel=2)
    kinds = set()
    for _ in range(STEPS):
        for mb in pipeline.next_step():
            kinds.add((mb["media"].images is not None, mb["media"].videos is not None))
    pipeline.close()
    assert {(False, False), (True, False), (False, True)} <= kinds


# The final checkpoints: the language attention output's Adam moment 1.5e-5 and a bias 1.1e-4 (the weights'
# bound is 10x the moments') measured in a fresh venv of 2026-12-07 (the same at the commit before that
# session), about 3x asserted; losses and grad norms keep 1e-5.
CHECKPOINT_REL = 4e-5


def test_full_trains_like_none_with_the_distributed_optimizer_and_overlap(full_run, none_run):
    assert_trains_alike(full_run, none_run, checkpoint_relative=CHECKPOINT_REL)
    held = step_metric(full_run, "vision_features_bytes")
    assert len(held) == STEPS and all(b > 0 for b in held)


def test_full_resumed_at_step_1_is_bit_identical(tmp_path, full_run):
    resumed = _resume_from_step_1(full_run, tmp_path / "resumed", "full", *DISTRIBUTED, *OVERLAP)
    assert losses(resumed) == losses(full_run)
    assert grad_norms(resumed) == grad_norms(full_run)
    differences = checkpoint_differences(resumed, full_run)
    assert max(differences.values()) == 0.0, max(differences, key=differences.get)


def test_a_full_checkpoint_loads_in_none(tmp_path, full_run, none_run):
    # The same optimizer kind as the checkpoint's; none with overlap would need every encoder
    # parameter to get a gradient in every micro-batch (a separate issue).
    resumed = _resume_from_step_1(full_run, tmp_path / "as_none", "none", *DISTRIBUTED)
    assert_trains_alike(resumed, none_run, checkpoint_relative=CHECKPOINT_REL)


def test_a_none_checkpoint_loads_in_full_with_the_encoder_recomputed(tmp_path, none_run):
    # parallel.encoder_full_recompute: the step's media encoded without a graph, then again in the
    # backward a micro-batch's patches at a time; the same math (the share's memory is the point).
    resumed = _resume_from_step_1(none_run, tmp_path / "as_full", "full", "parallel.encoder_full_recompute=true")
    assert_trains_alike(resumed, none_run)


def test_convert_exports_a_full_checkpoint(tmp_path, full_run, none_run):
    exported = []
    for name, run in (("full", full_run), ("none", none_run)):
        cfg = load_run_config(PRESET, overrides=[*SMALL_MODEL, *DATA], world_size=1)
        hf_dir = Path(export_hf(cfg.model, cfg.data, final_checkpoint(run), tmp_path / name).dst)
        exported.append({k: v for path in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(path).items()})
    assert set(exported[0]) == set(exported[1])
    # The encoder as saved once from the first stage (the language model is compared in the
    # checkpoints; split out of megatron's fused qkv, a language k bias that started at 0 carries
    # the 1e-6 absolute Adam noise that _assert_trains_alike allows, over a far smaller norm).
    vision = [key for key in exported[1] if "visual." in key]
    assert vision
    for key in vision:
        reference = exported[1][key].double()
        difference = (exported[0][key].double() - reference).norm()
        assert difference <= 10 * RELATIVE * max(reference.norm(), 1e-12), key


def _cost_file(path: Path, vision_share: float) -> Path:
    coefficients = {"sum_L": 1.0, "sum_P2": 0.05 * vision_share, "sum_P": 2.0 * vision_share}
    CostModel({t: 0.0 for t in TERMS} | coefficients, source="file").save(path)
    return path


def test_full_trains_like_none_with_balancing_on_packed_rows(tmp_path):
    # Rows of five or six packed samples (seq_len 512) and a cost model that prices the vision terms.
    # full's planner sees them at a quarter (four ranks share the encoder) and moves samples between
    # micro-batches. none is handed that quarter-priced model itself, so both train the very same
    # micro-batches: otherwise the language model's gradients are summed in another order (1e-7
    # relative), which Adam amplifies in biases that start at 0 (beyond the weights' bound, as noted
    # at seq_len 2048; at 512, measured: the language qkv bias ends 4.5e-5 apart over the default order's 3
    # steps, 3.7e-6 over these 2, bound 1e-4, and as far from a none run without balancing).
    # At DP 1 every plan scores max/LB 1 up to rounding, so a step is re-planned only where rounding
    # puts the arrival order above 1 (at least one of the 2 steps in both runs, asserted below).
    # data.seed=2: the first step is the one re-planned in both runs (measured; in the default order it
    # was the third, and the pair trained 3 steps for it), the second trains after an update.
    balanced = ("data.seq_len=512", "data.seed=2", "balance.enabled=true", "balance.threshold=0",
                "training.train_steps=2", "checkpoint.save_interval=2")
    full_run = _train(tmp_path / "full", "full", *balanced,
                      f"balance.cost_model={_cost_file(tmp_path / 'cost.json', 1.0)}")
    none_run = _train(tmp_path / "none", "none", *balanced,
                      f"balance.cost_model={_cost_file(tmp_path / 'quarter.json', 0.25)}")
    for run in (full_run, none_run):
        assert json.loads((run / "summary.json").read_text())["balance"]["applied_steps"] >= 1
    assert_trains_alike(full_run, none_run)
