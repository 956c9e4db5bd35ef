"""A process's memory as Linux reports it (`/proc/<pid>/status`), for readiness, metrics and the worker's budget."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MB = 1024 * 1024


@dataclass(frozen=True)
class ProcessMemory:
    """Resident set now and at its peak (`VmHWM`: since the process started, or since `reset_peak`), in bytes."""

    rss: int
    peak: int

    @classmethod
    def of(cls, pid: int | str = "self") -> ProcessMemory | None:
        """Read now; None where there is no such process or no `/proc` (not Linux)."""
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return None
        return cls.from_status(status)

    @classmethod
    def from_status(cls, status: str) -> ProcessMemory | None:
        """From the text of a `/proc/PID/status` already read; None for a process without memory lines."""
        found = {key: int(kb) * 1024 for key, kb in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M)}
        if "VmRSS" not in found:  # a zombie has no memory lines
            return None
        return cls(found["VmRSS"], found.get("VmHWM", found["VmRSS"]))

    @property
    def rss_mb(self) -> float:
        return self.rss / MB

    @property
    def peak_mb(self) -> float:
        return self.peak / MB


def reset_peak() -> bool:
    """Start this process's peak (`VmHWM`) afresh from its resident set now; False where Linux cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
