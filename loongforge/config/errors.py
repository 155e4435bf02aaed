"""The exception types the CLI turns into one-line messages and exit codes (``cli.errors``)."""

from __future__ import annotations

from typing import Iterable


class ConfigError(Exception):
    """One or more configuration problems, each a self-contained sentence with a remedy.

    Validation collects every problem it finds before raising, so a user fixes a config in one
    round instead of one error per run.
    """

    def __init__(self, messages: str | Iterable[str]):
        self.messages: list[str] = [messages] if isinstance(messages, str) else list(messages)
        if not self.messages:
            raise ValueError("ConfigError needs at least one message")
        super().__init__("\n".join(self.messages))


class InputError(Exception):
    """A file, folder or checkpoint the user pointed at cannot be used.

    The message names the path (and line or tensor where known) and says what to do instead; the
    CLI prints it as one line and exits with the usage code.
    """


class LaunchError(RuntimeError):
    """Worker processes failed; their own tracebacks were printed above this message."""
