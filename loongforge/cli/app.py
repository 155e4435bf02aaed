"""The ``loongforge`` command: assembles the subcommands, nothing else.

Each subcommand lives in its own module; shared option types are in ``options``, and the mapping
of library errors to messages and exit codes in ``errors``.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Optional

import typer

from loongforge import __version__
from loongforge.cli import bench, convert, encode, fit_cost, pack, profile, train
from loongforge.parallel.console import filter_known_warnings

app = typer.Typer(
    name="loongforge",
    help="Load-balanced training of vision-language models and LLMs on megatron-core.",
    no_args_is_help=True,
    add_completion=False,
    # Plain click output: one-line errors that scripts and logs can grep.
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
app.command("train", no_args_is_help=False)(train.train)
app.command("pack", no_args_is_help=True)(pack.pack)
app.command("convert", no_args_is_help=True)(convert.convert)
app.command("encode", no_args_is_help=True)(encode.encode)
app.command("profile", no_args_is_help=False)(profile.profile)
app.command("fit-cost", no_args_is_help=True)(fit_cost.fit_cost)
app.add_typer(bench.app, name="bench")


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    # Read from package metadata: importing torch/megatron just to print versions takes seconds.
    return (f"loongforge {__version__}\n"
            f"torch {_installed_version('torch')}\n"
            f"megatron-core {_installed_version('megatron-core')}")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def loongforge(
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print loongforge, torch and megatron-core versions, then exit.")] = None,
) -> None:
    """Load-balanced training of vision-language models and LLMs on megatron-core."""
    # Every command, before it imports megatron-core (encode, convert and profile build models too):
    # the known harmless third-party warnings stay off stderr. `train --verbose` shows them again
    # (train.launch installs its own filters over these).
    filter_known_warnings(verbose=False)


def main() -> None:
    app(prog_name="loongforge")


if __name__ == "__main__":
    main()
