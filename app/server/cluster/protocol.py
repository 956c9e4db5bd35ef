"""What an engine replica streams back for one job through its deployment handle (pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.server.worker.client import EngineHealth
from app.server.worker.protocol import JobResult


@dataclass(frozen=True)
class Refused:
    """The replica did not run the job: its queue is full, its worker is unavailable, or it is shutting down."""

    reason: Literal["queue_full", "unavailable", "no_model", "shutting_down"]
    message: str
    retry_after: int | None = None


@dataclass(frozen=True)
class Finished:
    """The job's result; `running_s`: how long it ran after it left the replica's queue."""

    result: JobResult
    running_s: float


@dataclass(frozen=True)
class ReplicaState:
    """One replica's engine, as its `state()` reports it."""

    health: EngineHealth
    depth: int
    inflight: int
