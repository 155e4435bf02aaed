"""bench pack: its lengths are the ones `pack` measures, and its rows are consistent."""

import numpy as np
from typer.testing import CliRunner

from loongforge.bench.datasets import COCO_CAPTIONS, coco_chats
from loongforge.bench.pack import BENCH_ALGORITHMS, fill_rows, format_fill_table, mixed_lengths
from loongforge.cli.app import app
from tests.shared_data import SHARED_DATA


def test_real_coco_set_and_fill_rows():
    path = SHARED_DATA / COCO_CAPTIONS
    assert path.exists(), f"shared data {path} not present (set LOONGFORGE_SHARED_DATA)"
    chats = coco_chats(path)
    assert len(chats) == 25014 and all(len(c.image_sizes) == 1 for c in chats)
    lengths = np.array([9000, 5000, 4000, 3000, 1000, 200, 100] * 20)
    rows = fill_rows("coco", lengths, 8192)
    assert [r["algorithm"] for r in rows] == list(BENCH_ALGORITHMS)
    assert all(r["too_long"] == 20 and r["samples"] == 120 and r["fill"] <= r["bound"] + 1e-12 for r in rows)
    assert "| coco | 8192 | 120 (20) |" in format_fill_table(rows)


def test_mixed_set_interleaves_every_sample_once():
    lengths = {"coco": np.arange(5), "mathvista": np.arange(5, 8), "arena_hard": np.arange(8, 9),
               "alpaca": np.arange(9, 12)}
    mixed = mixed_lengths(lengths)
    assert sorted(mixed.tolist()) == list(range(12)) and mixed.tolist() != list(range(12))
    assert np.array_equal(mixed, mixed_lengths(lengths))  # a fixed order


def test_cli_needs_a_data_root(monkeypatch, tmp_path):
    monkeypatch.delenv("LOONGFORGE_SHARED_DATA", raising=False)
    result = CliRunner().invoke(app, ["bench", "pack"])
    assert result.exit_code == 2
    assert "--data-root is not given" in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(app, ["bench", "pack", "--data-root", str(tmp_path)])
    assert result.exit_code == 2 and f"--data-root {tmp_path}: no coco2017" in result.output
