"""The top-level command: help, version, and what it registers."""

from __future__ import annotations

import importlib.metadata

from typer.testing import CliRunner

from loongforge import __version__
from loongforge.cli.app import app

runner = CliRunner()


def test_version_prints_loongforge_torch_and_megatron_versions():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0] == f"loongforge {__version__}"
    assert lines[1] == f"torch {importlib.metadata.version('torch')}"
    assert lines[2] == f"megatron-core {importlib.metadata.version('megatron-core')}"


def test_help_lists_the_seven_subcommands_each_with_its_own_help():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == ["train", "pack", "convert", "encode", "profile", "fit-cost", "bench"]
    for command in listed:
        assert runner.invoke(app, [command, "--help"]).exit_code == 0, command


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "Usage: loongforge" in result.output


def test_unknown_command_is_a_usage_error():
    result = runner.invoke(app, ["trian"])
    assert result.exit_code == 2
