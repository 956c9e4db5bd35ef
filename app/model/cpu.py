"""What this CPU is and which instruction sets it has, as Linux's /proc/cpuinfo names them (read once)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def _cpuinfo() -> str:
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def _field(name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo (the first CPU's), None if absent."""
    for line in _cpuinfo().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags ("avx2", "fma", "avx512_vnni", ...); empty where /proc/cpuinfo has none."""
    return frozenset((_field("flags") or "").split())


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, else what `platform` knows of it."""
    return _field("model name") or platform.processor() or platform.machine()
