"""Keep the pages of memory-mapped Arrow files from piling up in a process's resident set.

Reading a row of a memory-mapped file maps the page-cache pages around it into the process (a
recent Linux maps whole large folios, up to 2 MB per random row read, measured here), and they stay
mapped: after a few thousand random reads every rank's RSS holds most of the file, although the
file exists once per node in the page cache. Every ``every`` reads, the process's mappings of the
files are dropped with ``madvise(MADV_DONTNEED)``: the pages stay cached (the next read of them is
a minor fault, no I/O) and the RSS stays flat. Linux only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

_MADV_DONTNEED = 4


def _madvise():
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


class MappedPages:
    """Drops this process's mappings of ``files`` every ``every`` calls of ``read``."""

    def __init__(self, files: list[str], every: int = 4):
        self.files = {os.path.realpath(f) for f in files}
        self.every = every
        self._reads = 0
        self._ranges: Optional[list[tuple[int, int]]] = None  # address ranges mapping the files
        self._madvise = _madvise() if self.files else None

    def read(self) -> None:
        self._reads += 1
        if self._madvise is not None and self._reads % self.every == 0:
            self.release()

    def release(self) -> None:
        if self._madvise is None:
            return
        if not self._ranges:  # mappings do not move while the table is open (and survive fork)
            self._ranges = self._find_ranges()
        for start, end in self._ranges:
            self._madvise(start, end - start, _MADV_DONTNEED)

    def _find_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].rstrip("\n") in self.files:
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        ranges.append((start, end))
        except OSError:
            return []
        return ranges
