"""Where loongforge keeps what it builds once and reuses: built tokenizers, Arrow copies of data files.

``LOONGFORGE_CACHE`` overrides the default ``~/.cache/loongforge``; on a cluster point it (or
``data.cache_dir``) at node-local disk: every process of a node shares what the first one built.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional


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


_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_FULL = (errno.ENOSPC, errno.EDQUOT)


def cache_write_problem(error: OSError, cache: Path, doing: str) -> Optional[str]:
    """The one-line message for ``error``, met ``doing`` something (``making the Arrow copy of X``)
    in the cache folder ``cache``, when it says that folder is full or read-only; None when it is
    about something else (a data file that cannot be read is its own problem). pyarrow's write
    errors carry no errno, only the system's words."""
    filename = getattr(error, "filename", None)
    if filename is not None and not Path(os.fsdecode(filename)).resolve().is_relative_to(cache.resolve()):
        return None
    text = str(error)
    if error.errno in _FULL or "No space left on device" in text or "Disk quota exceeded" in text:
        return (f"data.cache_dir {cache} is full ({os.strerror(error.errno or errno.ENOSPC)}) while {doing}; free "
                "space there or point data.cache_dir (or LOONGFORGE_CACHE) at a larger node-local disk")
    about_cache = filename is not None or str(cache) in text  # pyarrow's errors name the file in their text
    read_only = error.errno in _READ_ONLY or "Read-only file system" in text or "Permission denied" in text
    if about_cache and read_only:
        return (f"data.cache_dir {cache} is not writable ({os.strerror(error.errno or errno.EROFS)}) while {doing}; "
                "point data.cache_dir (or LOONGFORGE_CACHE) at a writable node-local folder")
    return None
