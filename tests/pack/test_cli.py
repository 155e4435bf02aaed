"""`loongforge pack` and `loongforge bench pack` on the command line: summary, one-line errors."""

import json

from typer.testing import CliRunner

from loongforge.cli.app import app
from tests.console import assert_no_third_party_warning, console_of
from tests.data.conftest import write_conversations
from tests.pack.conftest import PRESET

runner = CliRunner()


def test_pack_command_writes_folder_and_prints_summary(pack_inputs, tmp_path, capfd):
    out = tmp_path / "out"
    result, stderr = console_of(capfd, lambda: runner.invoke(app, [
        "pack", *pack_inputs, "--output", str(out), "--preset", PRESET, "--seq-len", "2048", "--algorithm", "ffd",
        "--no-progress"]))
    assert result.exit_code == 0, result.output
    assert_no_third_party_warning(stderr, "pack")
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


def test_pack_for_context_parallel_needs_a_seq_len_the_padding_divides(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    result = runner.invoke(app, ["pack", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--seq-len", "1022",
                                 "--context-parallel", "2", "--no-progress"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output == ("error: --seq-len 1022 must be a multiple of 4 (2 x --context-parallel 2: every sample is "
                             "padded to a multiple of it); use 1020 or 1024.\n")


def test_bench_has_pack_subcommand():
    result = runner.invoke(app, ["bench", "pack", "--help"])
    assert result.exit_code == 0 and "--plan-samples" in result.output


def _pack(*args: str):
    return runner.invoke(app, ["pack", *args, "--preset", PRESET, "--seq-len", "1024", "--no-progress"])


def test_pack_unreadable_inputs_and_file_output_are_one_line_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "no_data").mkdir()
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "taken").write_text("a file")
    cases = [([str(tmp_path / "empty.jsonl"), "--output", str(tmp_path / "o1")], "is empty"),
             ([str(tmp_path / "no_data"), "--output", str(tmp_path / "o2")], "holds no .json/.jsonl/.parquet"),
             ([str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "taken")], "is a file, not a folder")]
    for args, fragment in cases:
        result = _pack(*args)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert result.output.startswith("error: ") and fragment in result.output, result.output


def test_pack_that_writes_no_packs_fails_with_counts_by_reason(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{}\n{}\n")
    result = _pack(str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: 0 packs written: 2 of 2 samples rejected (malformed_json 2)"), result.output
    assert (tmp_path / "out" / "rejects.jsonl").is_file()  # kept for a look


def test_pack_of_a_mixture_input_whose_every_sample_is_rejected_stops_before_writing(tmp_path):
    """Issue 49, pack: a weighted input none of whose samples can be packed gave its share to the
    others (exit 0, a folder without a row of it). Now training's one line, exit 2, and no folder."""
    good = write_conversations(tmp_path / "good.jsonl", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n" * 3)
    out = tmp_path / "out"
    result = _pack(f"{good}@1", f"{bad}@1", "--output", str(out))  # the module's tokenizer, loaded once
    stats = json.loads((out / "stats.json").read_text()) if (out / "stats.json").is_file() else None
    print(f"pack {good.name}@1 {bad.name}@1: exit {result.exit_code}, {result.output.splitlines()[0]!r}, "
          f"folder left: {sorted(p.name for p in out.iterdir()) if out.exists() else None}, "
          f"sources: {stats and stats.get('sources')}")
    assert result.exit_code == 2 and result.output == (
        f"error: input {str(bad)!r}: all 3 samples were rejected (malformed_json: 3); fix them or drop "
        "the entry (its weight would go to the other entries)\n")
    assert not out.exists()
