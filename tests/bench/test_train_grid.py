"""The grid of training runs the encoder-sharing benches share (``bench.train_grid``): figures read
from metrics records (warm-up left out, repeats pooled, ranks without the encoder kept as None),
the mirrored run order, the baseline rule, and the COCO chats the runs train on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongforge.bench.encoder_dp import GRID
from loongforge.bench.train_grid import coco_chats, compare, measure_run, run_order
from tests.bench.fake_metrics import step_records
from tests.shared_data import SHARED_DATA


def test_measure_skips_warmup_and_keeps_ranks_without_encoder_as_none():
    run = measure_run("tp2pp2", "tp", step_records([2.0, 1.0, None, None], 5.0, [100, 100, 50, 50]), 1)
    assert run.steps == 2
    assert run.encoder_cpu_s == [2.0, 1.0, None, None]
    assert run.encoder_s == [4.0, 2.0, None, None]
    assert (run.max_encoder_cpu_s, run.mean_encoder_cpu_s) == (2.0, 1.5)
    assert run.step_s == 5.0
    assert run.slowest_encoder_share == pytest.approx(2.0 / 5.0)  # rank 0: its encoder / its step CPU
    assert run.peak_memory_mib == [103, 103, 53, 53]  # the last step's high water


def test_repeats_mirror_the_mode_order_and_pool_their_steps():
    assert run_order(["tp2", "tp2pp2"], ["none", "tp"], 2) == [
        ("tp2", "none", 0), ("tp2", "tp", 0), ("tp2", "tp", 1), ("tp2", "none", 1),
        ("tp2pp2", "none", 0), ("tp2pp2", "tp", 0), ("tp2pp2", "tp", 1), ("tp2pp2", "none", 1)]
    pooled = measure_run("tp2", "tp", step_records([2.0, 2.0], 4.0, [100, 300])
                         + step_records([4.0, 4.0], 6.0, [200, 100]), 1)
    assert pooled.steps == 4 and pooled.encoder_cpu_s == [3.0, 3.0] and pooled.step_s == 5.0
    assert pooled.peak_memory_mib == [203, 303]  # the high water over both runs, per rank


def test_a_run_without_measured_steps_names_itself():
    with pytest.raises(ValueError, match="tp2 tp: no step after the 3 warm-up steps"):
        measure_run("tp2", "tp", step_records([1.0, 1.0], 1.0, [1, 1]), 3)


def test_compare_needs_the_baseline_of_every_layout():
    runs = [measure_run(layout, mode, step_records([1.0, 1.0], 1.0, [1, 1]), 1)
            for layout, mode in (("tp2", "none"), ("tp2", "tp"), ("tp2pp2", "tp"))]
    with pytest.raises(ValueError, match=r"no encoder_dp=none run for layout\(s\) \['tp2pp2'\]"):
        compare(runs, GRID)


def test_coco_chats_show_real_photos_with_their_captions():
    chats = coco_chats(SHARED_DATA, images_per_sample=3, samples=20)
    assert len(chats) == 20
    assert all(len(c["images"]) == 3 and c["messages"][0]["content"].count("<image>") == 3 for c in chats)
    assert all(Path(image).is_file() for c in chats for image in c["images"])
    assert len({image for c in chats for image in c["images"]}) == 50  # 60 slots cycle the 50 photos
    json.dumps(chats)
