"""The benchmarks' markdown tables (what a report holds and the terminal shows)."""

from __future__ import annotations

from typing import Iterable, Sequence

_ALIGNMENT = {"l": "---", "r": "---:"}


def markdown_table(header: Sequence[str], alignment: str, rows: Iterable[Sequence[object]]) -> str:
    """A table of ``header`` and ``rows`` (cells already formatted); ``alignment``, a letter a column:
    ``l`` left (markdown's default), ``r`` right (numbers)."""
    lines = [_row(header), "|" + "|".join(_ALIGNMENT[a] for a in alignment) + "|"]
    return "\n".join([*lines, *(_row(cells) for cells in rows)])


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"
