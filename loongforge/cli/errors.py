"""The one place library errors become one-line CLI messages with an exit code.

Every configuration or usage problem exits with 2 (the code click uses for usage errors), so
scripts can tell "fix your command" from "the run failed" (1).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

from loongforge.config.errors import ConfigError, InputError, LaunchError

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1


class UsageError(Exception):
    """A command-line mistake the config layer cannot see (conflicting flags and the like)."""


def _print_error(message: str) -> None:
    typer.echo(f"error: {message}", err=True)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Run a command body, turning known library errors into messages and exit codes."""
    try:
        yield
    except ConfigError as exc:
        for message in exc.messages:
            _print_error(message)
        raise typer.Exit(USAGE_EXIT_CODE) from None
    except (UsageError, InputError) as exc:
        _print_error(str(exc))
        raise typer.Exit(USAGE_EXIT_CODE) from None
    except LaunchError as exc:
        _print_error(f"{exc}; their tracebacks are above. Fix the cause and rerun "
                     f"(add --resume to continue from the last checkpoint).")
        raise typer.Exit(FAILURE_EXIT_CODE) from None
