"""The request queue: collects requests into batches of up to `max_batch` and feeds the worker.

Three lanes keep live latency low without starving uploads: a finished live utterance goes
first, then uploads, then live partials (re-transcriptions of an utterance still being
spoken). A partial that has waited longer than `partial_max_wait_s` is taken before uploads
so that live text keeps moving under upload load. A finished utterance that arrives while the
worker runs a batch of partials only preempts it: the partials are refused (`Preempted`) and
stopped in the worker at its next encoder layer or decoder pass, and the final runs next.
Finished utterances and partials never share a batch: where batching does not make a row
cheaper (a CPU encodes each row's window in turn), partials riding along would delay the final
by their encoding, and a batch holding a final could not be preempted for the next one.

The work of long uploads (`Job.background`: a chunk, a window of a single-block upload) is batched
with its own kind only, and goes after the rest of its lane. A short upload or a finished utterance
that arrives while it runs is sent to the worker at once, with whatever else short is waiting (up to
the room the running batch leaves of `max_batch`, or of the memory budget's cap): the worker runs it
inside the running batch, at that batch's next encoder layer or decoder pass, and the long jobs then go
on where they were (`BatchRunner.waiting`). Where there is no room (a `max_batch` of 1, a tight memory
budget), it preempts them instead: they are stopped in the worker, queued again at the head of their
lane (not refused), run again from their start, and are not preempted a second time; a resumed job
(its earlier windows kept in the worker) or a streamed one (it would send its segments twice) is never
stopped.

With a worker memory budget (`app.server.worker.budget`), no batch holds more clips than the budget allows
(`memory_cap`), whatever its lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections import deque

from app.api.types import Segment
from app.server.metrics import ServerMetrics
from app.server.worker.client import Lane, Pending, Preempted, QueueFull, ShuttingDown, WorkerUnavailable
from app.server.worker.protocol import Job, JobResult, Progress
from app.server.worker.supervisor import WorkerSupervisor

log = logging.getLogger("specwhisper.batcher")


class Batcher:
    """Bounded, laned queue in front of the worker; one batch runs at a time."""

    def __init__(
        self,
        worker: WorkerSupervisor,
        metrics: ServerMetrics,
        max_batch: int,
        window_s: float,
        queue_size: int,
        partial_max_wait_s: float = 1.0,
        max_queued_samples: int | None = None,
        max_rows: int | None = None,
        max_background: int | None = None,
    ) -> None:
        self.worker = worker
        self.metrics = metrics
        self.max_batch = max_batch
        # decoding rows a batch may take (a beam-5 request takes 5); a request wider than this runs alone
        self.max_rows = max_rows if max_rows is not None else max_batch
        self.max_background = max_background if max_background is not None else max_batch  # jobs of long uploads
        self.memory_cap: int | None = None  # clips a batch may hold within the worker's memory budget (None: no budget)
        self.window_s = window_s
        self.queue_size = queue_size
        self.partial_max_wait_s = partial_max_wait_s
        self.max_queued_samples = max_queued_samples
        self.lanes: dict[Lane, deque[Pending]] = {lane: deque() for lane in Lane}
        self.running: list[Pending] = []  # the batch the worker runs
        self.inner: list[Pending] = []  # short jobs the worker runs inside `running` (a batch of long uploads' jobs)
        self._nesting: asyncio.Future[None] | None = None  # sends the inner batches while `running` runs
        self.batch_seconds = 1.0  # moving average of a batch's run time: what a 429's Retry-After is based on
        self._arrived = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved on by one batch beyond its current depth (1..60)."""
        batches = self.depth / max(1, self.max_batch) + 1
        return max(1, min(60, math.ceil(batches * self.batch_seconds)))

    @property
    def inflight(self) -> int:
        """Jobs the worker runs now."""
        return len(self.running) + len(self.inner)

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self.lanes.values())

    @property
    def queued_samples(self) -> int:
        return sum(p.job.length for q in self.lanes.values() for p in q if not p.future.done())

    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        self.worker.check_ready()
        # A finished utterance may use the last slots; uploads and partials leave room for it.
        limit = self.queue_size if lane is Lane.LIVE_FINAL else max(1, self.queue_size - self.max_batch)
        if self.depth >= limit:
            raise QueueFull(self.retry_after())
        # The queue holds decoded audio (4 bytes a sample); a long file waits only where it fits.
        budget = self.max_queued_samples
        if budget is not None and self.depth and self.queued_samples + job.length > budget:
            raise QueueFull(self.retry_after())
        progress: asyncio.Queue[list[Segment]] | None = asyncio.Queue() if job.stream else None
        pending = Pending(job, asyncio.get_running_loop().create_future(), lane, progress)
        self.lanes[lane].append(pending)
        if lane is Lane.LIVE_FINAL:
            self._preempt_partials()
        if lane is not Lane.LIVE_PARTIAL and not job.background:
            self._preempt_background()
        self._arrived.set()
        self.metrics.queue_depth.set(self.depth)
        return pending

    def _preempt_partials(self) -> None:
        """A finished utterance is waiting: a running batch of nothing but partials makes room for it."""
        if not self.running or any(p.lane is not Lane.LIVE_PARTIAL for p in self.running):
            return
        for p in self.running:
            if not p.future.done():
                p.future.set_exception(Preempted())
                self.metrics.partials_preempted.inc()
                self._send_cancel(p.job.request_id)

    def _preempt_background(self) -> None:
        """A short job is waiting while a batch of long uploads' jobs runs: it runs inside that batch where the worker
        has room for it (`_nest`); else the batch is stopped, if all its jobs may be (they queue again when the worker
        answers)."""
        if not self.running or not all(p.job.background for p in self.running):
            return
        if self._room_inside() > 0:
            if self._nesting is None or self._nesting.done():
                self._nesting = asyncio.ensure_future(self._nest())
            return
        if not all(p.preemptible and not p.future.done() for p in self.running):
            return
        for p in self.running:
            p.preempted = True
            self.metrics.background_preempted.inc()
            self._send_cancel(p.job.request_id, keep=True)

    def _room_inside(self) -> int:
        """Clips a batch run inside the running one may hold: what the running one leaves of a batch's most."""
        most = self.max_batch if self.memory_cap is None else min(self.max_batch, self.memory_cap)
        return most - len(self.running)

    async def _nest(self) -> None:
        """While a batch of long uploads' jobs runs, send the short jobs waiting, a batch at a time, to run in it."""
        while self.running and all(p.job.background for p in self.running) and not self._closed:
            batch = self._take_short(self._room_inside())
            if not batch:
                return
            self.metrics.inner_batches.inc()
            self.inner = batch
            try:
                await self._dispatch(batch)
            finally:
                self.inner = []

    def _take_short(self, room: int) -> list[Pending]:
        """Up to `room` waiting jobs that are not long uploads' (finals, then uploads; no partials), by lane order."""
        batch: list[Pending] = []
        rows = 0
        while len(batch) < room:
            item = self._take(Lane.LIVE_PARTIAL)
            if item is None:
                break
            if item.job.background or (batch and rows + item.job.options.rows > self.max_rows):
                self.lanes[item.lane].appendleft(item)
                break
            if not item.future.done():
                batch.append(item)
                rows += item.job.options.rows
        self.metrics.queue_depth.set(self.depth)
        return batch

    def _send_cancel(self, request_id: str, *, keep: bool = False) -> None:
        task = asyncio.ensure_future(self.worker.cancel(request_id, keep=keep))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _take(self, apart: Lane | None = None) -> Pending | None:
        """The next request by lane priority (a partial that waited over `partial_max_wait_s` goes before
        uploads, never before a finished utterance), none from lane `apart`; cancelled requests are dropped
        before they cost work."""
        for q in self.lanes.values():
            while q and q[0].future.done():
                q.popleft()
                self.metrics.queue_dropped.inc()
        if self.lanes[Lane.LIVE_FINAL] and apart is not Lane.LIVE_FINAL:
            return self.lanes[Lane.LIVE_FINAL].popleft()
        partials = self.lanes[Lane.LIVE_PARTIAL]
        if (
            partials
            and apart is not Lane.LIVE_PARTIAL
            and time.perf_counter() - partials[0].enqueued > self.partial_max_wait_s
        ):
            return partials.popleft()
        for lane in Lane:
            if self.lanes[lane] and lane is not apart:
                return self._next_in(self.lanes[lane])
        return None

    @staticmethod
    def _next_in(q: deque[Pending]) -> Pending:
        """The earliest of the jobs that are not `background`, else of those of the lowest `turn`: a chunked
        upload's later chunks let the first job of every other upload go first."""
        best = min(range(len(q)), key=lambda i: (q[i].job.background, q[i].job.turn))
        pending = q[best]
        del q[best]
        return pending

    @staticmethod
    def _apart(batch: list[Pending]) -> Lane | None:
        """The lane a batch may not take from: partials once it holds a final, finals once it holds a partial."""
        lanes = {p.lane for p in batch}
        if Lane.LIVE_FINAL in lanes:
            return Lane.LIVE_PARTIAL
        return Lane.LIVE_FINAL if Lane.LIVE_PARTIAL in lanes else None

    def _requeue(self, batch: list[Pending]) -> None:
        """Put a batch still being collected back at the head of its lanes, in its order."""
        for p in reversed(batch):
            self.lanes[p.lane].appendleft(p)

    async def _collect(self) -> list[Pending]:
        while (first := self._take()) is None:
            self._arrived.clear()
            await self._arrived.wait()
        batch = [first]
        rows = first.job.options.rows
        deadline = time.perf_counter() + self.window_s
        most = self.max_background if first.job.background else self.max_batch
        if self.memory_cap is not None:
            most = min(most, self.memory_cap)
        while len(batch) < most and rows < self.max_rows:
            apart = self._apart(batch)
            if self.lanes[Lane.LIVE_FINAL] and apart is Lane.LIVE_FINAL:
                self._requeue(batch)  # a final arrived while partials gathered: it leads, they wait
                return await self._collect()
            item = self._take(apart)
            if item is not None and item.job.background != first.job.background:
                self.lanes[item.lane].appendleft(item)
                if first.job.background and item.lane is not Lane.LIVE_PARTIAL:
                    # A short upload or a final arrived while long ones gathered: it leads, they wait (`_take`
                    # gives it before them; a partial it would not, so a partial waits for the next batch).
                    self._requeue(batch)
                    return await self._collect()
                break
            if item is not None and rows + item.job.options.rows > self.max_rows:
                self.lanes[item.lane].appendleft(item)  # too wide for this batch: it leads the next one
                break
            if item is None:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                continue
            batch.append(item)
            rows += item.job.options.rows
        self.metrics.queue_depth.set(self.depth)
        return batch

    def _on_progress(self, by_id: dict[str, Pending], message: Progress) -> None:
        pending = by_id.get(message.request_id)
        if pending is not None and pending.progress is not None:
            pending.progress.put_nowait(message.segments)

    def _resume_later(self, pending: Pending) -> None:
        """A job the worker suspended (its windows so far kept there) queues again, after its lane's first turns; if
        its client left meanwhile, the worker is told to drop it."""
        if pending.future.done():
            self._send_cancel(pending.job.request_id)
            return
        pending.job = dataclasses.replace(pending.job, resume=True, turn=pending.job.turn + 1)
        self.lanes[pending.lane].append(pending)
        self._arrived.set()

    def _run_again(self, preempted: list[Pending]) -> None:
        """Preempted jobs queue again at the head of their lanes, in their order (a client may have left meanwhile:
        then its job is dropped when taken)."""
        if preempted:
            self._requeue(preempted)
            self._arrived.set()

    def _cancel_when_abandoned(self, pending: Pending) -> None:
        """A job whose client leaves (or times out) once it has run is stopped in the worker at its next window,
        or dropped there if suspended."""

        def on_done(future: asyncio.Future[JobResult]) -> None:
            if future.cancelled() and (self.inflight or pending.job.resume):
                self._send_cancel(pending.job.request_id)

        pending.future.add_done_callback(on_done)

    async def _loop(self) -> None:
        while True:
            collected = await self._collect()
            batch = [p for p in collected if not p.future.done()]  # a client may leave while a batch fills
            self.metrics.queue_dropped.inc(len(collected) - len(batch))
            if not batch:
                continue
            self.running = batch
            try:
                await self._dispatch(batch)
            finally:
                self.running = []
                if self._nesting is not None:  # its last batch, sent as this one ended, is answered first
                    await asyncio.wait([self._nesting])  # (never raises for how it ended; not cancelled with us)

    async def _dispatch(self, batch: list[Pending]) -> None:
        """Run `batch` in the worker and settle its requests: answered, queued again (preempted) or to resume later
        (suspended), or failed with the worker's error. Never raises: one batch must not stop the batcher."""
        now = time.perf_counter()
        for p in batch:
            if not p.dispatched:
                p.dispatched = now
                self._cancel_when_abandoned(p)
        self.metrics.batch_size.observe(len(batch))
        streaming = {p.job.request_id: p for p in batch if p.progress is not None}
        try:
            results = await self.worker.run([p.job for p in batch], functools.partial(self._on_progress, streaming))
            self.batch_seconds = 0.8 * self.batch_seconds + 0.2 * (time.perf_counter() - now)
        except WorkerUnavailable as exc:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(WorkerUnavailable(str(exc)))
        except Exception as exc:
            log.exception("batch failed")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
        else:
            again = [
                p
                for p, r in zip(batch, results, strict=True)
                if p.preempted and r.transcription is not None and r.transcription.finish == "cancelled"
            ]
            self._run_again(again)
            for p, r in zip(batch, results, strict=True):
                if p in again:
                    continue
                if r.suspended:
                    self._resume_later(p)
                elif not p.future.done():
                    p.future.set_result(r)
                elif r.transcription is not None and r.transcription.finish == "cancelled":
                    self.metrics.running_cancelled.inc()

    async def drain(self, timeout: float) -> None:
        """Stop accepting; wait for queued and running work up to `timeout`."""
        self._closed = True
        deadline = time.monotonic() + timeout
        while (self.depth or self.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for q in self.lanes.values():
            while q:
                p = q.popleft()
                if not p.future.done():
                    p.future.set_exception(ShuttingDown("the server shut down before this request ran"))
