"""``train data.vision_embeddings=DIR`` on the LLaMA-Factory demo images and videos, encoded once
by ``loongforge encode``: the same per-step losses and grad norms (1e-5) as training with the
encoder online and frozen (tower and merger), at DP 1 and at DP 2 with balancing re-planning every
step, across a stop and ``--resume``; a sample without stored embeddings is a counted reject; an
encoder or processor mismatch is a one-line error before anything is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loongforge.convert.checkpoint_folders import step_dir_name
from loongforge.data.conversations import read_data_file
from tests.forked_cli import run_cli
from tests.shared_data import SHARED_DATA
from loongforge.config.loader import load_run_config
from loongforge.config.errors import InputError
from loongforge.data.embedding_store import processor_settings
from loongforge.train.vision_embeddings import _check_processor, frozen_encoder_note
from tests.train.conftest import (
    PRESET,
    SAVE_AT_END,
    SMALL_VIDEOS,
    assert_close_relative,
    assert_quiet_stderr,
    grad_norms,
    losses,
    run_train,
)

RELATIVE = 1e-5
STEPS = 6
DEMO = SHARED_DATA / "llamafactory"
FILES = (DEMO / "mllm_demo.json", DEMO / "mllm_video_demo.json")
# What encode and train must agree on (conftest's SMALL_MODEL sets data.max_pixels=12544).
# seq_len 256: rows of two or three samples.
MEDIA = ("data.seq_len=256", "data.max_pixels=12544", *SMALL_VIDEOS)
RUN = ("data.source=files", f"data.paths=[{FILES[0]},{FILES[1]}]", *MEDIA, f"training.train_steps={STEPS}",
       "training.global_batch_size=2")
FROZEN = ("training.freeze_vision=true", "training.freeze_projector=true")
BALANCED = ("balance.enabled=true", "balance.threshold=0")


def _encode(out: Path, *inputs: Path, settings: tuple = MEDIA) -> Path:
    sets = [arg for setting in settings for arg in ("--set", setting)]
    proc = run_cli(["encode", *inputs, "--output", out, "--preset", PRESET, "--dtype", "fp32", "--no-progress", *sets])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Forked: the imports are the fork server's (a fresh encode's ranks: test_encode.py's two-process run).
    assert_quiet_stderr(proc.stderr, "encode")
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _encode(tmp_path_factory.mktemp("embeddings") / "demo", *FILES)


def _assert_same_training(a: Path, b: Path) -> None:
    assert len(losses(a)) == STEPS
    assert_close_relative(losses(a), losses(b), RELATIVE)
    assert_close_relative(grad_norms(a), grad_norms(b), RELATIVE)


def test_stored_embeddings_train_like_the_frozen_encoder(store, tmp_path):
    run_train(tmp_path / "online", *RUN, *FROZEN)
    stored = run_train(tmp_path / "stored", *RUN, f"data.vision_embeddings={store}", SAVE_AT_END)
    _assert_same_training(tmp_path / "stored", tmp_path / "online")
    # It leaves freeze_vision / freeze_projector false: its start-up lines say they change nothing.
    start = stored.stdout.splitlines()[:6]
    assert any(line.startswith("encoder: frozen: data.vision_embeddings holds the projector's outputs")
               and "(this run: training.freeze_vision=false, training.freeze_projector=false)" in line
               for line in start), start
    meta = json.loads((tmp_path / "stored" / "checkpoints" / step_dir_name(STEPS) / "meta.json").read_text())
    assert meta["vision_embeddings_encoder_digest"] == json.loads((store / "encoder.json").read_text())["weights_digest"]


def test_at_dp2_with_balancing_and_across_a_resume(store, tmp_path):
    run_train(tmp_path / "online", *RUN, *FROZEN, *BALANCED, nproc=2)
    stored = tmp_path / "stored"
    run_train(stored, *RUN, *BALANCED, f"data.vision_embeddings={store}", "training.exit_at_step=3",
              SAVE_AT_END, nproc=2)
    assert len(losses(stored)) == 3
    run_train(stored, *RUN, *BALANCED, f"data.vision_embeddings={store}", nproc=2, resume=True)
    assert json.loads((stored / "summary.json").read_text())["balance"]["applied_steps"] > 0
    _assert_same_training(stored, tmp_path / "online")


def test_a_sample_without_stored_embeddings_is_a_counted_reject(tmp_path):
    images_only = _encode(tmp_path / "images", FILES[0])
    # Rows of 512: every demo conversation fits (the longest is 360 tokens with the small vocabulary),
    # so the only rejects are the samples without embeddings.
    run_train(tmp_path / "run", *RUN, f"data.vision_embeddings={images_only}", "training.train_steps=2",
              "data.seq_len=512")
    rejects = [json.loads(line) for line in (tmp_path / "run" / "rejects.jsonl").read_text().splitlines()]
    videos = json.loads(FILES[1].read_text())
    assert {r["reason"] for r in rejects} == {"missing_embedding"}
    assert {(r["file"], r["line"]) for r in rejects} == {(str(FILES[1]), line) for line in _record_lines(FILES[1])}
    assert len(rejects) == len(videos)


def _record_lines(path: Path) -> list[int]:
    return [located.line for located in read_data_file(path)]


@pytest.mark.parametrize("override, expected", [
    ("training.seed=7", "was encoded with encoder weights sha256:"),
    ("data.max_pixels=50176", "was encoded with other image/video settings (vision_sizing.max_pixels: "),
])
def test_a_store_from_another_encoder_or_other_settings_is_a_one_line_error(store, tmp_path, override, expected):
    proc = run_train(tmp_path / "run", *RUN, f"data.vision_embeddings={store}", override, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: data.vision_embeddings={store} ") and expected in message, message


@pytest.mark.parametrize("preset, video_rule", [("internvl3.5-tiny", None), ("qwen2.5vl-tiny", "qwen2_vl"),
                                                ("qwen3vl-tiny", "qwen3_vl")])
def test_the_recorded_video_rule_is_the_familys_and_a_model_without_videos_reads_older_stores(preset, video_rule):
    """Stores encoded before the video rule came from the family recorded Qwen2-VL's for every model; a
    model that takes no videos still reads them (its features never met the rule). No run started."""
    cfg = load_run_config(preset)
    ours = processor_settings(cfg.data, cfg.model)
    assert ours["vision_sizing"]["video_rule"] == video_rule
    older = {**ours, "vision_sizing": {**ours["vision_sizing"], "video_rule": "qwen2_vl"}}
    if video_rule in (None, "qwen2_vl"):
        _check_processor(cfg, SimpleNamespace(root="store", encoder={"processor": older}))
    else:
        with pytest.raises(InputError, match=r"\(vision_sizing.video_rule: "):
            _check_processor(cfg, SimpleNamespace(root="store", encoder={"processor": older}))
    changed = {**ours, "vision_sizing": {**ours["vision_sizing"], "video_max_pixels": 1}}
    with pytest.raises(InputError, match=r"\(vision_sizing.video_max_pixels: "):
        _check_processor(cfg, SimpleNamespace(root="store", encoder={"processor": changed}))


def test_packed_data_at_tp2(tmp_path):
    """A `pack` folder encoded as it is, trained at TP 2 (2 processes): as the frozen encoder."""
    packed = tmp_path / "packed"
    proc = subprocess.run([sys.executable, "-m", "loongforge.cli.app", "pack", *map(str, FILES), "--output",
                           str(packed), "--preset", PRESET, "--seq-len", "256", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_quiet_stderr(proc.stderr, "pack")
    # The pack's image rules are the preset's: encode and train with them.
    preset_media = ("data.seq_len=256", "data.max_pixels=50176")
    stored = _encode(tmp_path / "embeddings", packed, settings=preset_media)
    run = ("data.source=packed", f"data.packed={packed}", *preset_media, "training.train_steps=3",
           "training.global_batch_size=2", "parallel.tensor_model_parallel_size=2")
    run_train(tmp_path / "online", *run, *FROZEN, nproc=2)
    run_train(tmp_path / "stored", *run, f"data.vision_embeddings={stored}", nproc=2)
    assert_close_relative(losses(tmp_path / "stored"), losses(tmp_path / "online"), RELATIVE)
    assert_close_relative(grad_norms(tmp_path / "stored"), grad_norms(tmp_path / "online"), RELATIVE)


def test_a_run_on_stored_features_says_the_projector_is_not_trained(tmp_path):
    """Issue 30, item 14: the store holds the projector's outputs; a run that leaves
    training.freeze_projector=false (or freeze_vision) is told, naming what it left on."""
    files = ("data.source=files", f"data.paths=[{FILES[0]}]", f"data.vision_embeddings={tmp_path}")
    assert frozen_encoder_note(load_run_config(PRESET)) is None  # the encoder runs online
    frozen = load_run_config(PRESET, overrides=[*files, *FROZEN])
    assert frozen_encoder_note(frozen) is None
    note = frozen_encoder_note(load_run_config(PRESET, overrides=[*files, "training.freeze_vision=true"]))
    print(f"\n{note}")
    assert note.startswith("encoder: frozen: data.vision_embeddings holds the projector's outputs, so neither the "
                           "vision tower nor the projector runs or trains here")
    assert "(this run: training.freeze_projector=false)" in note
