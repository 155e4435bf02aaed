"""The benchmarks' figures: a headless matplotlib figure, and saving one as a PNG.

matplotlib is imported at the first figure (only plotting needs it), on the Agg backend so that a
machine without a display draws too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def subplots(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``matplotlib.pyplot.subplots`` on the Agg backend: (figure, axes)."""
    import matplotlib  # lazy: only plotting needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend on import

    return plt.subplots(*args, **kwargs)


def save_figure(figure: Any, path: Path, dpi: int = 110) -> None:
    """Lay ``figure`` out, write it to ``path`` as a PNG and close it (pyplot keeps every figure open
    until then)."""
    import matplotlib.pyplot as plt  # lazy: only plotting needs matplotlib (subplots imported it)

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
