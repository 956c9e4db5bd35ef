"""Give freed heap memory back to the OS: the worker's while it is idle, the web process's as it frees it.

A batch allocates hundreds of MB of short-lived tensors (encoder activations, KV caches sized by the
batch's shapes). glibc keeps freed chunks in its arenas, so the worker's resident size drifts with the
largest batches it has seen rather than with what it holds. `malloc_trim(0)` hands the free pages back
(measured here: 1.17-1.43 GB after a batch -> 1.00 GB, in 14-32 ms). The worker calls it only after
a quarter of a second without a new batch, so a loaded worker never pays for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def heap_trimmer() -> Callable[[], None] | None:
    """`malloc_trim(0)` of the C library when it has one (glibc), else None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def run() -> None:
        trim(0)

    return run


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
M_ARENA_MAX = -8


def limit_heap(arenas: int, mmap_threshold: int) -> bool:
    """Hold the process's heap to `arenas` glibc arenas, and serve blocks of `mmap_threshold` bytes or more from
    maps of their own, given back when freed (a fixed threshold; glibc's own rises after each such block is freed,
    up to 32 MB, after which a freed buffer of decoded audio stays in an arena). False where the C library is
    not glibc. Meant for the web process, whose threads read uploads into buffers of a few MB: measured under
    `python -m app storm`, 2 arenas and 256 kB took its peak from 597 to 504 MB. Call it early: arenas made
    before keep going."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas)) and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))
