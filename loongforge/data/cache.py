"""Where loongforge keeps what it builds once and reuses: built tokenizers, Arrow copies of data files.

``LOONGFORGE_CACHE`` overrides the default ``~/.cache/loongforge``; on a cluster point it (or
``data.cache_dir``) at node-local disk: every process of a node shares what the first one built.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("LOONGFORGE_CACHE") or Path.home() / ".cache" / "loongforge")


def write_cache_file(path: Path, text: str) -> None:
    """Write ``path`` atomically. Several processes may write it at once; each writes a private
    temp file and renames it over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared by users of the machine
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
