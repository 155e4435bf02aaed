"""bench data at a small size: real rank processes for both readers, the same first step from each,
and a report that names its command and ratios. The processes are forked from the tests' fork server
(``start_method="forkserver"``): eight spawned interpreters importing torch were most of the test's time;
``run_spawned``'s spawned processes are tests/bench/test_processes.py's."""

import json
from dataclasses import replace

import pytest

from loongforge.bench.data import _check_same_first_steps, chat_pool, plot, report, run_data_bench, write_inputs
from loongforge.parallel import fork_server
from tests.models.helpers import WORKER_PRELOAD
from tests.shared_data import SHARED_DATA


def test_inputs_are_real_chats_with_real_image_paths(tmp_path):
    pool = chat_pool(SHARED_DATA)
    assert len(pool) > 27_000  # COCO captions + MathVista + arena-hard + alpaca
    path = tmp_path / "chats.jsonl"
    written = write_inputs(path, 3000, SHARED_DATA)
    lines = path.read_text().split("\n")[:-1]  # not splitlines: texts hold U+2028
    assert len(lines) == 3000 and written == path.stat().st_size
    records = [json.loads(line) for line in lines]
    images = [image for r in records for image in r["images"]]
    assert images and all(image.endswith(".jpg") and SHARED_DATA.joinpath(image).exists() for image in images[:50])
    assert sum(not r["images"] for r in records) > 0  # text-only chats too
    assert all(r["messages"][0]["content"].count("<image>") == len(r["images"]) for r in records)


def test_both_readers_start_the_same_first_step(tmp_path):
    fork_server.ensure(WORKER_PRELOAD)  # the session's, as run_workers starts it
    bench = run_data_bench(SHARED_DATA, tmp_path / "work", sizes=(500,), baseline_max=500, preset="qwen2.5vl-tiny",
                           dp=2, global_batch_size=4, start_method="forkserver")
    assert [(r.reader, r.cache) for r in bench.rows] == [("arrow", "cold"), ("arrow", "warm"), ("in-memory", "-")]
    assert all(r.peak_rss_bytes > 100 * 2**20 and r.first_step_s > 0 for r in bench.rows)
    assert bench.rows[0].cache_bytes > bench.rows[0].input_bytes // 2 and bench.rows[2].cache_bytes == 0
    assert len(bench.rows[0].first_step_ids) == 2 and all(bench.rows[0].first_step_ids)  # rank 0: 2 of 4 rows
    assert [(r.reader, r.samples) for r in bench.reader_rows] == [("arrow", 500), ("in-memory", 500)]
    assert all(r.reads_per_s > 100 and r.peak_rss_bytes > 20 * 2**20 for r in bench.reader_rows)
    assert all(0 < r.private_bytes < r.peak_rss_bytes for r in bench.rows)
    assert not list((tmp_path / "work").iterdir())
    text = report(bench, "data.png", "loongforge bench data --samples 500")
    assert "`loongforge bench data --samples 500`" in text
    assert "in-memory / Arrow, peak RSS of the reader alone at 500" in text
    plot(bench, tmp_path / "data.png")
    assert (tmp_path / "data.png").stat().st_size > 10_000
    moved = replace(bench.rows[2], first_step_ids=bench.rows[2].first_step_ids[::-1])
    with pytest.raises(RuntimeError, match="in-memory reader's first step at 500 samples holds other samples"):
        _check_same_first_steps([bench.rows[0], moved])
