"""The contract between the serving layer and the engine behind it: submit a job to a lane, read the state.

Two kinds of engine keep it: `LocalWorker` (a worker process on this machine behind the laned queue) and,
on a Ray cluster, `app.server.cluster.client.ServeEngineClient` (engine replicas of a Ray Serve deployment,
each a `LocalWorker`). The serving layer (routes, limits, metrics) is the same over both.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.api.types import Segment
from app.server.worker.budget import MemoryPlan
from app.server.worker.protocol import Job, JobResult, Ready


class QueueFull(RuntimeError):
    """The engine's queue is full; `retry_after`: seconds until it has likely moved on (None: ask the client)."""

    def __init__(self, retry_after: int | None = None) -> None:
        super().__init__("the queue is full")
        self.retry_after = retry_after


class Preempted(QueueFull):
    """A live partial stopped in the worker to make room for a finished utterance (best effort: skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.args = ("stopped to make room for a finished utterance",)


class ShuttingDown(RuntimeError):
    """The engine stopped accepting work."""


class WorkerUnavailable(RuntimeError):
    """The worker is loading, restarting, or died while running the batch."""


class NoUsableModel(WorkerUnavailable):
    """The worker cannot load the models the settings name, and is not restarted: retrying is futile."""


class Lane(enum.IntEnum):
    """A job's priority in the queue: a finished live utterance, an upload, a live partial."""

    LIVE_FINAL = 0
    UPLOAD = 1
    LIVE_PARTIAL = 2


@dataclass
class Pending:
    """A submitted job: its result comes in `future`; cancelling the future drops or stops the job."""

    job: Job
    future: asyncio.Future[JobResult]
    lane: Lane = Lane.UPLOAD
    progress: asyncio.Queue[list[Segment]] | None = None  # segments of a streaming job, as they come
    enqueued: float = field(default_factory=time.perf_counter)
    dispatched: float = 0.0  # when it began to run (perf_counter); 0 while it waits
    preempted: bool = False  # stopped once to let a short job run first: it runs to its end next time

    @property
    def preemptible(self) -> bool:
        """A long upload's job that may be stopped mid-window and run again from its start: it holds no state in
        the worker (not `resume`), sends no segments as it goes (`stream`: run again, it would send them twice)
        and was not preempted before."""
        return self.job.background and not self.job.resume and not self.job.stream and not self.preempted


async def progress_until(
    progress: asyncio.Queue[list[Segment]], done: asyncio.Future[Any]
) -> AsyncIterator[list[Segment]]:
    """A streaming job's segments as they come (`Pending.progress`), until `done` (its result, or what waits for
    it) is complete and every segment has been taken."""
    while not (done.done() and progress.empty()):
        if not progress.empty():
            yield progress.get_nowait()
            continue
        arrival = asyncio.ensure_future(progress.get())
        try:
            await asyncio.wait([arrival, done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not arrival.done():
                arrival.cancel()  # nothing came: `done` completed (or the caller left)
        if arrival.done() and not arrival.cancelled():
            yield arrival.result()


@dataclass(frozen=True)
class EngineHealth:
    """What readiness and the metrics report of the engine."""

    ready: Ready | None  # the models and engine of a ready worker (of one replica on a cluster)
    is_ready: bool
    restarts: int = 0
    pid: int | None = None  # the worker process (None on a cluster: each replica has its own)
    failure: str | None = None  # why the models cannot be loaded, when that is final
    replicas: int | None = None  # engine replicas running (None: one local worker)
    memory: MemoryPlan | None = None  # the worker's memory budget and the batch it holds now (None: no budget)


class EngineClient(Protocol):
    """The engine as the serving layer sees it."""

    @property
    def depth(self) -> int:
        """Jobs waiting to run."""
        ...

    @property
    def inflight(self) -> int:
        """Jobs running now (as far as this process knows)."""
        ...

    def health(self) -> EngineHealth: ...

    def retry_after(self) -> int:
        """Seconds a client turned away with 429 should wait (1..60)."""
        ...

    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        """Queue a job. Raises QueueFull, ShuttingDown or WorkerUnavailable (NoUsableModel when final) when it
        cannot be taken now; the same errors may also come later through `Pending.future`."""
        ...

    async def start(self) -> None: ...

    async def close(self, timeout: float) -> None:
        """Stop accepting, finish queued and running work for up to `timeout` s, then release the engine."""
        ...
