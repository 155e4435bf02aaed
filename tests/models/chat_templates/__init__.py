"""Published chat templates, written here as their models ship them (facts of the models; never fetched): each
``NAME.jinja`` is one template's text, byte for byte, the source named where a test reads it."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent


def published_template(name: str) -> str:
    """The text of ``NAME.jinja`` here, exactly (no trailing newline is added or stripped)."""
    return (_HERE / f"{name}.jinja").read_text(encoding="utf-8")
