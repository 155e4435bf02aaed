"""Where loongforge keeps what it builds once and reuses: built tokenizers, Arrow copies of data files.

``LOONGFORGE_CACHE`` overrides the default ``~/.cache/loongforge``; on a cluster point it (or
``data.cache_dir``) at node-local disk: every process of a node shares what the first one built.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LOONGFORGE_CACHE") or Path.home() / ".cache" / "loongforge")
