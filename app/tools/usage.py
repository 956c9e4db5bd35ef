"""What processes use, read from Linux's /proc: resident memory, CPU time, and a sampler of their peak memory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from app.server.memory import ProcessMemory


def rss_mb(pid: int) -> float:
    """Resident memory of a live process (MB); 0 once it is gone."""
    memory = ProcessMemory.of(pid)
    return memory.rss_mb if memory is not None else 0.0


def cpu_s(pid: int | None) -> float:
    """CPU time a process has used so far (user + system, s); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: the stat's 14th, 15th


class PeakSampler:
    """Samples the total resident memory of some processes every 20 ms in a thread; `peak` since `reset`."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, sum(rss_mb(p) for p in self.pids))

    def now(self) -> float:
        return sum(rss_mb(p) for p in self.pids)

    def reset(self) -> None:
        self.peak = self.now()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
