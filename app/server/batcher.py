"""The request queue: collects requests into batches of up to `max_batch` and feeds the worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from app.server.metrics import ServerMetrics
from app.server.protocol import Job, JobResult
from app.server.supervisor import WorkerSupervisor, WorkerUnavailable

log = logging.getLogger("specwhisper.batcher")


class QueueFull(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    pass


@dataclass
class Pending:
    job: Job
    future: asyncio.Future[JobResult]
    enqueued: float = field(default_factory=time.perf_counter)
    dispatched: float = 0.0


class Batcher:
    """Bounded asyncio queue in front of the worker; one batch runs at a time."""

    def __init__(
        self, worker: WorkerSupervisor, metrics: ServerMetrics, max_batch: int, window_s: float, queue_size: int
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.max_batch = max_batch
        self.window_s = window_s
        self.queue: asyncio.Queue[Pending] = asyncio.Queue(maxsize=queue_size)
        self.inflight = 0
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    @property
    def depth(self) -> int:
        return self.queue.qsize()

    def submit(self, job: Job) -> Pending:
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        if not self.worker.is_ready:
            raise WorkerUnavailable("the worker is not ready")
        pending = Pending(job, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull as exc:
            raise QueueFull from exc
        self.metrics.queue_depth.set(self.queue.qsize())
        return pending

    async def _collect(self) -> list[Pending]:
        first = await self.queue.get()
        batch = [first]
        deadline = time.perf_counter() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.perf_counter()
            try:
                item = (
                    self.queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(self.queue.get(), remaining)
                )
            except (asyncio.QueueEmpty, TimeoutError):
                break
            batch.append(item)
        self.metrics.queue_depth.set(self.queue.qsize())
        # Requests whose clients went away are dropped before they cost any work.
        return [p for p in batch if not p.future.done()]

    async def _loop(self) -> None:
        while True:
            batch = await self._collect()
            if not batch:
                continue
            now = time.perf_counter()
            for p in batch:
                p.dispatched = now
            self.inflight = len(batch)
            self.metrics.batch_size.observe(len(batch))
            try:
                results = await self.worker.run([p.job for p in batch])
            except WorkerUnavailable as exc:
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(WorkerUnavailable(str(exc)))
            except Exception as exc:  # never let one batch stop the loop
                log.exception("batch failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
            else:
                for p, r in zip(batch, results, strict=True):
                    if not p.future.done():
                        p.future.set_result(r)
            finally:
                self.inflight = 0

    async def drain(self, timeout: float) -> None:
        """Stop accepting; wait for queued and running work up to `timeout`."""
        self._closed = True
        deadline = time.monotonic() + timeout
        while (self.queue.qsize() or self.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self.queue.empty():
            p = self.queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(ShuttingDown("the server shut down before this request ran"))
