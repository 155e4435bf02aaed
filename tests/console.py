"""What a command shows on the console's stderr, and the check every subcommand's test makes of it: no
third-party warning line (issue 49), from the command's process or any rank it starts.

A command run as a subprocess hands its stderr over (its ranks write to the same stream). A command run
in this process (``CliRunner``) is seen by ``console_of``: pytest records and hides the warnings raised
here (and pyproject's ``filterwarnings`` ignores UserWarning), so it shows the ones that pass the filters
the command installs, as Python would print them, and adds what the processes it started wrote to fd 2.
Warnings that megatron-core issues once, when it is first imported, are then long past: the
subprocess runs see those.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Callable, TypeVar

import loongforge

T = TypeVar("T")

# Python's warnings print "<file>:<line>: <Category>: <message>", then the source line.
WARNING_LINE = re.compile(r"^(?P<file>\S[^:]*\.py):\d+: (?P<category>\w*Warning): ")
_OURS = Path(loongforge.__file__).resolve().parent
# What a console shows by default besides what the command filters (Python's default filters).
_HIDDEN_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def third_party_warning_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that open a warning issued outside loongforge."""
    return [line for line in stderr.splitlines()
            if (match := WARNING_LINE.match(line)) and not Path(match["file"]).resolve().is_relative_to(_OURS)]


def assert_no_third_party_warning(stderr: str, what: str) -> None:
    """Prints the count (``pytest -s``) of ``what``'s third-party warning lines, and fails on any."""
    lines = third_party_warning_lines(stderr)
    print(f"\n{what}: {len(lines)} third-party warning line(s) on stderr")
    assert not lines, f"{what}: stderr holds {len(lines)} third-party warning line(s):\n" + "\n".join(lines)


def console_of(capfd, command: Callable[[], T]) -> tuple[T, str]:
    """``command()`` (a ``CliRunner`` invoke of a loongforge command) and its console's stderr: the
    warnings raised in this process that pass the command's filters, formatted as Python prints them,
    then what the processes it started (spawned ranks) wrote to fd 2."""
    capfd.readouterr()  # what came before is not the command's
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")  # each warning once per place, as a console shows it
        for category in _HIDDEN_BY_DEFAULT:
            warnings.simplefilter("ignore", category)
        result = command()
    raised_here = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return result, raised_here + capfd.readouterr().err
