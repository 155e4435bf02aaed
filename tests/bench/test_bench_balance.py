"""``loongforge bench balance``: data readers, the simulation's JSON shape, and the CLI."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from loongforge.balance.cost_model import default_cost_model
from loongforge.bench.balance import load_pool, run_balance_bench
from loongforge.bench.datasets import INTERNVL_TILE_PATCHES
from loongforge.cli.app import app
from loongforge.config.errors import InputError
from tests.shared_data import SHARED_DATA

ROW_KEYS = {"dp", "ga", "strategy", "max_over_mean", "max_over_lb", "gain", "plan_ms_p50", "plan_ms_p99"}
STRATEGIES = {"none", "token", "reference", "loongforge"}


@pytest.fixture
def omnibal_csv(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "costs.csv"
    lines = ["vit_num,token_num,image_flags"]
    for _ in range(600):
        tiles = int(rng.integers(0, 6))
        lines.append(f"{tiles},{int(rng.integers(50, 3000)) + 256 * tiles},{tiles}")
    lines.append("1,99999,1")  # longer than any seq_len used here: dropped
    path.write_text("\n".join(lines) + "\n")
    return path


def test_omnibal_rows_become_tiles_of_1024_patches(omnibal_csv):
    pool = load_pool([omnibal_csv], preset="qwen2.5vl-tiny", seq_len=8192)
    assert len(pool.tokens) == 600 and pool.dropped_too_long == 1
    first = omnibal_csv.read_text().splitlines()[1].split(",")
    assert pool.tokens[0] == int(first[1])
    assert pool.patches[0] == (INTERNVL_TILE_PATCHES,) * int(first[0])
    assert INTERNVL_TILE_PATCHES == 1024


def test_pack_manifest_folder(tmp_path):
    rows = [{"samples": [{"tokens": 100, "patches": [64]}, {"tokens": 50, "patches": []}]},
            {"samples": [{"tokens": 300, "patches": [256, 16]}]}]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pool = load_pool([tmp_path], preset="qwen2.5vl-tiny", seq_len=1024)
    assert pool.tokens == [100, 50, 300]
    assert pool.patches == [(64,), (), (256, 16)]
    costs, tokens = pool.arrays(default_cost_model())
    assert costs.shape == (3,) and (costs > 0).all()


def test_unreadable_inputs_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_pool([tmp_path / "missing.csv"], preset="qwen2.5vl-tiny", seq_len=1024)
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="vit_num,token_num"):
        load_pool([bad], preset="qwen2.5vl-tiny", seq_len=1024)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "manifest.jsonl").write_text('{"rows": []}\n')
    with pytest.raises(InputError, match="manifest"):
        load_pool([tmp_path / "m"], preset="qwen2.5vl-tiny", seq_len=1024)


def test_bench_rows_shape_and_ordering(omnibal_csv):
    bench = run_balance_bench([omnibal_csv], preset="qwen2.5vl-tiny", seq_len=8192,
                              dp_sizes=(2, 4), micro_batches=(1, 2), steps=3)
    assert len(bench.rows) == 2 * 2 * 4
    for row in bench.rows:
        assert set(row) == ROW_KEYS
        assert row["max_over_lb"] <= row["max_over_mean"] + 1e-12  # LB >= the mean rank load
        assert row["max_over_lb"] >= 1 - 1e-9
    by = {(r["dp"], r["ga"], r["strategy"]): r for r in bench.rows}
    for dp in (2, 4):
        for ga in (1, 2):
            assert by[(dp, ga, "none")]["gain"] == 0.0
            ours, ref = by[(dp, ga, "loongforge")], by[(dp, ga, "reference")]
            assert ours["max_over_lb"] <= ref["max_over_lb"] + 1e-9
            assert ours["gain"] >= ref["gain"] - 1e-9


def test_cli_json(omnibal_csv):
    result = CliRunner().invoke(app, ["bench", "balance", "--data", str(omnibal_csv), "--preset",
                                      "qwen2.5vl-tiny", "--seq-len", "8192", "--dp", "2,4", "--ga", "1,2",
                                      "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert set(payload) == {"rows"}
    assert len(payload["rows"]) == 16
    assert {r["strategy"] for r in payload["rows"]} == STRATEGIES
    assert all(set(r) == ROW_KEYS for r in payload["rows"])


def test_cli_writes_table_and_plot(omnibal_csv, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "balance", "--data", str(omnibal_csv), "--seq-len", "8192",
                                      "--dp", "2", "--ga", "2", "--steps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 2 | 2 | loongforge |" in result.output
    assert (out / "gain_vs_dp.png").stat().st_size > 1000
    assert "max/LB" in (out / "balance.md").read_text()


@pytest.mark.parametrize("args,message", [
    (["--dp", "8,x"], "--dp '8,x': expected comma-separated integers"),
    (["--ga", "0"], "--ga '0': expected positive integers"),
    (["--seq-len", "40"], "no usable samples"),
])
def test_cli_usage_errors(omnibal_csv, args, message):
    result = CliRunner().invoke(app, ["bench", "balance", "--data", str(omnibal_csv), "--steps", "1",
                                      "--json", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_real_omnibal_subset_meets_the_target():
    path = SHARED_DATA / "omnibal" / "omnibal_internvl_docvqa.csv"
    bench = run_balance_bench([path], preset="qwen2.5vl-7b", seq_len=16384, dp_sizes=(8, 32),
                              micro_batches=(4,), steps=3)
    ours = [r for r in bench.rows if r["strategy"] == "loongforge"]
    assert all(r["max_over_lb"] <= 1.01 for r in ours)
    assert all(r["gain"] > 0 for r in ours)


def test_conversation_files_are_measured_like_pack():
    pool = load_pool([SHARED_DATA / "llamafactory" / "mllm_demo.json"], preset="qwen2.5vl-7b", seq_len=16384)
    assert len(pool.tokens) == 6 and pool.rejected == 0
    # Every demo sample has one or two images; patches are counted before the 2x2 merge, and the
    # merged image tokens are part of the sample's length.
    assert all(len(p) in (1, 2) and all(x % 4 == 0 for x in p) for p in pool.patches)
    assert all(t > sum(p) // 4 for t, p in zip(pool.tokens, pool.patches))
