"""The web process's heap: freed audio buffers go back to the OS.

The web process's threads read uploads into buffers of a few MB (a step of decoded audio, its copies). glibc
serves blocks that large from maps of their own only up to a threshold that it raises each time such a block is
freed (up to 32 MB); past that, a freed buffer stays in one of the per-thread arenas, and the process's size
follows the most it ever held at once. A fixed threshold and 2 arenas keep it to what it holds: measured under
`python -m app storm` (docs/reliability.md), the web process's peak went from 597 to 504 MB.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_ARENA_MAX = -8


def limit_heap(arenas: int, mmap_threshold: int) -> bool:
    """At most `arenas` glibc arenas, and blocks of `mmap_threshold` bytes or more in maps of their own (given back
    when freed). False where the C library has no `mallopt` (musl, macOS). Call it early: arenas made before
    keep going."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas)) and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))
