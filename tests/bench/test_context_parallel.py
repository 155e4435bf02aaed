"""``bench context-parallel``: the grid read back from fake metrics files (no training) into the
table, the summary, the report files and the document; the runs' configs; the bad flags; and the
FLOP prediction of encoder_cp on a long-video row, on a stand-in family whose FLOPs are known."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from loongforge.bench import encoder_dp_predict
from loongforge.bench.context_parallel import GRID, LAYOUTS, MODES, run_context_parallel_bench
from loongforge.bench.encoder_dp_predict import GroupCost, LongVideoRow, predict_context_parallel
from loongforge.bench.train_grid import DATA_FILE, PRESET, BenchSettings, coco_chats, run_overrides
from loongforge.cli.app import app
from loongforge.config.loader import load_run_config
from loongforge.config.validate import check_run_config
from loongforge.models.flops import StepFlops
from tests.bench.fake_metrics import step_records, write_run
from tests.shared_data import SHARED_DATA

# Encoder CPU seconds per rank of each run: off, every rank encodes the row's 8 photos.
ENCODER_CPU_S = {("cp2", "off"): [8.0, 8.0], ("cp2", "on"): [4.4, 3.6],
                 ("cp4", "off"): [8.0, 8.0, 8.0, 8.0], ("cp4", "on"): [2.4, 2.0, 1.6, 2.0]}
MEMORY_MIB = {"off": 1000, "on": 800}
SETTINGS = BenchSettings(steps=3, warmup_steps=1)


@pytest.fixture
def fake_runs(tmp_path):
    """The bench's --out folder as four training runs leave it (3 steps each, step 1 the warm-up)."""
    for (layout, mode), encoder in ENCODER_CPU_S.items():
        step_s = 10.0 if mode == "off" else 6.0
        write_run(tmp_path / layout / mode / "run0", step_records(encoder, step_s, [MEMORY_MIB[mode]] * len(encoder)))
    return tmp_path


def test_the_grid_reads_every_run_against_off_in_its_layout(fake_runs):
    bench = run_context_parallel_bench(fake_runs, None, settings=SETTINGS, report_only=True,
                                       command_line=["loongforge", "bench", "context-parallel"])
    cp2_on, cp4_on = bench.comparison("cp2", "on"), bench.comparison("cp4", "on")
    assert cp2_on.encoder_ratio == pytest.approx(4.4 / 8.0) and cp2_on.mean_encoder_ratio == pytest.approx(0.5)
    assert cp4_on.encoder_ratio == pytest.approx(2.4 / 8.0) and cp4_on.mean_encoder_ratio == pytest.approx(0.25)
    assert cp4_on.step_ratio == pytest.approx(0.6) and cp4_on.memory_ratio == pytest.approx(803 / 1003)
    assert bench.comparison("cp4", "off").encoder_ratio == 1.0
    assert "| layout | encoder_cp | encoder CPU s per rank | encoder vs off (slowest / mean rank) |" in bench.table
    assert "| CP2 (2 processes) | on | 4.40 / 3.60 | 0.55 / 0.50 | 8.80 / 7.20 | 6.00 | 0.60 |" in bench.table
    assert "| CP4 (4 processes) | on | 2.40 / 2.00 / 1.60 / 2.00 | 0.30 / 0.25 |" in bench.table
    report = (fake_runs / "context_parallel.md").read_text()
    assert "CP4 (4 processes): encoder_cp=on encoder time (slowest rank) 0.30x off, step 0.60x" in report
    runs = json.loads((fake_runs / "context_parallel.json").read_text())["runs"]
    assert [(r["layout"], r["mode"]) for r in runs] == [(layout, mode) for layout in LAYOUTS for mode in MODES]
    assert (fake_runs / "context_parallel.png").stat().st_size > 0


def test_a_missing_run_says_to_train_first(tmp_path):
    with pytest.raises(Exception, match="run the bench without --report-only first"):
        run_context_parallel_bench(tmp_path, None, settings=SETTINGS, report_only=True)


@pytest.mark.parametrize("layout,mode", [(layout, mode) for layout in LAYOUTS for mode in MODES])
def test_each_run_is_a_valid_config_on_the_same_rows(layout, mode, tmp_path):
    processes = LAYOUTS[layout].processes
    cfg = load_run_config(PRESET, world_size=processes, overrides=run_overrides(
        GRID, layout, mode, tmp_path / "d.json", tmp_path / "o", SETTINGS))
    assert check_run_config(cfg, world_size=processes) == []
    assert cfg.parallel.context_parallel_size == processes and cfg.parallel.encoder_cp == (mode == "on")
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.encoder_dp) == (1, "none")
    assert cfg.data.sample_multiple == 8  # the same padding, so the same rows, at CP 2 and CP 4


@pytest.mark.parametrize("args,message", [
    (["--layouts", "cp3"], "--layouts 'cp3': expected comma-separated names from cp2 | cp4"),
    (["--steps", "2", "--warmup-steps", "2"], "--warmup-steps 2 leaves no measured step of --steps 2"),
])
def test_a_bad_flag_is_one_line_and_exit_2(args, message, tmp_path):
    result = CliRunner().invoke(app, ["bench", "context-parallel", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}"


def test_the_command_prints_the_prediction_beside_nemo_and_writes_the_doc(fake_runs, monkeypatch):
    chats = coco_chats(SHARED_DATA, images_per_sample=4, samples=8)
    (fake_runs / DATA_FILE).write_text(json.dumps(chats))
    doc = fake_runs / "doc" / "context_parallel.md"
    args = ["bench", "context-parallel", "--data-root", str(SHARED_DATA), "--out", str(fake_runs), "--steps", "3",
            "--report-only", "--doc", str(doc)]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/loongforge", *args])  # what the document quotes
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| one 16k-token video | 2 | " in result.output
    assert "about +19% tokens/s per GPU" in result.output
    text = doc.read_text()
    assert f"```\nloongforge {' '.join(args)}\n```" in text  # the command that made it
    assert "| CP2 (2 processes), measured | " in text and "| CP4 (4 processes), predicted (FLOPs) | " in text
    assert "| the same video as 16 clips | 8 | " in text and "NeMo AutoModel PR #2990" in text


def test_the_doc_says_where_a_measured_ratio_is_below_the_flop_ratio(fake_runs):
    from loongforge.bench.context_parallel_doc import format_doc
    from loongforge.bench.encoder_dp_predict import MixPrediction

    bench = run_context_parallel_bench(fake_runs, None, settings=SETTINGS, report_only=True)
    flop_ratio = dict(name="chats", samples=8, rows=4, images_per_row=8.0, patches_per_image=936.0, language=1.0)
    predicted = [MixPrediction(encoder_alone=100.0, encoder_shared=60.0, **flop_ratio),  # CP2: 0.55 measured
                 MixPrediction(encoder_alone=100.0, encoder_shared=25.0, **flop_ratio)]  # CP4: 0.30 measured
    text = format_doc(bench, [], [LongVideoRow("video")], predicted, command_line=["loongforge"])
    assert "At CP2 the measured encoder ratio (0.55) is below the FLOP ratio (0.60)" not in text  # within 10%
    assert "At CP4" not in text
    predicted[0].encoder_shared = 80.0
    text = format_doc(bench, [], [LongVideoRow("video")], predicted, command_line=["loongforge"])
    assert "At CP2 the measured encoder ratio (0.55) is below the FLOP ratio (0.80)" in text


# ------------------------------------------------------------------------------------ prediction


def test_group_cost_arithmetic():
    # Language 800 FLOPs and encoder 200 over CP 4: a rank's 200 + 200 off, 200 + 50 on.
    cost = GroupCost(encoder_alone=200.0, encoder_shared=50.0, language=200.0)
    assert cost.encoder_share_alone == 0.5 and cost.encoder_ratio == 0.25
    assert cost.step_ratio == pytest.approx(250 / 400) and cost.gain == pytest.approx(0.6)


def _linear_flops(model_cfg, samples, options):
    """A stand-in family's FLOPs: 1 per patch (vision), 10 per token (language), 2 per loss token."""
    patches = sum(sum(sample.patches) for sample in samples)
    return StepFlops(vision=float(patches), projector=0.0, language=10.0 * sum(s.tokens for s in samples),
                     lm_head=2.0 * sum(s.loss_tokens for s in samples))


@pytest.fixture
def linear_family(monkeypatch):
    monkeypatch.setattr(encoder_dp_predict, "get_family", lambda name: SimpleNamespace(training_flops=_linear_flops))
    return SimpleNamespace(family="stand-in")


def test_a_video_divides_by_frames_and_whole_it_would_not(linear_family):
    # A 1,000-token row with 100 loss tokens: language 10,000 + 200 FLOPs; a video of 8 x 4 x 4 = 128 patches.
    video = dict(tokens=1000, video_grid=(8, 4, 4), loss_tokens=100)
    whole = predict_context_parallel(linear_family, LongVideoRow("video", **video), 2)
    assert whole.whole_media.language == 5100.0 and whole.whole_media.encoder_alone == 128.0
    assert whole.whole_media.encoder_shared == 128.0  # one medium: one rank encodes it all
    assert whole.frames.encoder_shared == 64.0  # 8 frames of 16 patches: 4 each
    assert whole.frames.step_ratio == pytest.approx((5100 + 64) / (5100 + 128))
    clips = predict_context_parallel(linear_family, LongVideoRow("4 clips", clips=4, **video), 8)
    assert clips.whole_media.language == pytest.approx(10200 / 8)
    assert clips.whole_media.encoder_shared == 32.0  # 4 clips of 32 patches over 8 ranks: one clip each at most
    assert clips.frames.encoder_shared == 16.0
    uneven = predict_context_parallel(linear_family, LongVideoRow("video", **{**video, "video_grid": (3, 4, 4)}), 2)
    assert uneven.frames.encoder_shared == 32.0  # 3 frames over 2 ranks: the slowest holds 2 of 16 patches


def test_the_long_video_row_is_16k_merged_tokens_and_clips_must_divide_it():
    row = LongVideoRow("one video")
    assert sum(t * h * w for t, h, w in row.grids()) // 4 == 16384 and row.grids() == [(64, 32, 32)]
    assert LongVideoRow("clips", clips=16).grids() == [(4, 32, 32)] * 16
    with pytest.raises(ValueError, match="64 temporal patches do not split into 3 equal clips"):
        LongVideoRow("clips", clips=3).grids()


def test_at_7b_one_video_gains_by_frames_with_cp_and_nothing_whole():
    from loongforge.bench.encoder_dp_predict import predict_long_video

    predictions = predict_long_video(rows=[LongVideoRow("one video")], sizes=(2, 8))
    assert all(p.whole_media.step_ratio == 1.0 for p in predictions)
    cp2, cp8 = (p.frames.gain for p in predictions)
    assert 0 < cp2 < cp8
