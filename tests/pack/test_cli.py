"""`loongforge pack` and `loongforge bench pack` on the command line: summary, one-line errors."""

import json

from typer.testing import CliRunner

from loongforge.cli.app import app
from tests.pack.conftest import PRESET

runner = CliRunner()


def test_pack_command_writes_folder_and_prints_summary(pack_inputs, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pack", *pack_inputs, "--output", str(out), "--preset", PRESET, "--seq-len", "2048",
                                 "--algorithm", "ffd", "--no-progress"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert f"into {stats['packs']} packs" in result.output and "samples/s" in result.output
    assert stats["algorithm"] == "ffd"
    again = runner.invoke(app, ["pack", *pack_inputs, "--output", str(out), "--preset", PRESET, "--seq-len", "2048",
                                "--no-progress"])
    assert again.exit_code == 2 and again.output.startswith("error: ") and "--resume" in again.output


def test_pack_command_usage_errors_are_one_line(tmp_path):
    missing = runner.invoke(app, ["pack", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o"),
                                  "--seq-len", "1024", "--no-progress"])
    assert missing.exit_code == 2 and missing.output.count("\n") == 1 and "does not exist" in missing.output
    (tmp_path / "a.jsonl").write_text("{}\n")
    bad = runner.invoke(app, ["pack", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"),
                              "--seq-len", "1024", "--algorithm", "worst", "--no-progress"])
    assert bad.exit_code == 2 and "--algorithm 'worst' is unknown" in bad.output


def test_bench_has_pack_subcommand():
    result = runner.invoke(app, ["bench", "pack", "--help"])
    assert result.exit_code == 0 and "--plan-samples" in result.output
