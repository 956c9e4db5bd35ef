"""The serving layer's engine on a Ray cluster: jobs go to engine replicas through a deployment handle.

Serve routes each job to a replica with room (at most `max_ongoing_requests` each) and queues it in the
handle while none has; the replica streams its progress and result back. A job whose replica dies (its
actor, or its worker process) is sent once more to another replica: decoding is deterministic, so a
streaming job's retry skips the segments already delivered. A replica's full queue, or a handle whose own
queue is full (`max_queued_requests`), answers 429 as the standalone server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.server.cluster.export import RayMetricsExport
from app.server.cluster.protocol import Finished, Refused, ReplicaState
from app.server.worker.client import (
    EngineHealth,
    Lane,
    NoUsableModel,
    Pending,
    QueueFull,
    ShuttingDown,
    WorkerUnavailable,
)
from app.server.worker.protocol import Job, JobResult
from app.settings import Settings

log = logging.getLogger("specwhisper.cluster")

RETRIES = 1  # a job whose replica died is sent once more
STATE_EVERY_S = 1.0
STATE_STALE_S = 10.0  # no replica answered for this long: not ready


class ServeEngineClient:
    """An `EngineClient` over the engine replicas' deployment handle.

    `replicas()` counts the running replicas (Serve's controller knows); readiness and the model's description
    come from one replica's `state()`, polled every second. `export`, when given, runs while the client does.
    A replica exists only once its models are loaded (models that cannot load fail its constructor, and Serve
    reports the deployment unhealthy), so "no replica yet" is the one reason to turn a job away here.
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        settings: Settings,
        replicas: Callable[[], int] | None = None,
        export: RayMetricsExport | None = None,
    ) -> None:
        self.handle = handle
        self._stream = handle.options(stream=True)
        self.settings = settings
        self.count_replicas = replicas
        self.export = export
        self.outstanding = 0
        self._state: ReplicaState | None = None
        self._state_at = 0.0
        self._replicas: int | None = None
        self._retry_after = 1
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._poll: asyncio.Task[None] | None = None

    # -- state -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Ask a replica for its state once (readiness is known from the first request on, when one runs),
        then every second in the background."""
        await self._update_state()
        self._poll = asyncio.create_task(self._poll_state(), name="replica-state")
        if self.export is not None:
            self.export.start()

    async def _update_state(self) -> None:
        try:
            self._state = await asyncio.wait_for(self.handle.state.remote(), 5.0)
            self._state_at = time.monotonic()
            if self.count_replicas is not None:
                self._replicas = await asyncio.to_thread(self.count_replicas)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # no replica yet, or one going: readiness shows it
            log.debug("replica state: %s", exc)

    async def _poll_state(self) -> None:
        while True:
            await asyncio.sleep(STATE_EVERY_S)
            await self._update_state()

    @property
    def _fresh(self) -> bool:
        return self._state is not None and time.monotonic() - self._state_at < STATE_STALE_S

    def health(self) -> EngineHealth:
        if self._state is None:
            return EngineHealth(None, False, replicas=self._replicas)
        h = self._state.health
        return EngineHealth(h.ready, h.is_ready and self._fresh, h.restarts, None, h.failure, self._replicas)

    @property
    def depth(self) -> int:
        """This ingress's jobs beyond what its replicas can run at once (an estimate: replicas batch them)."""
        return self.outstanding - self.inflight

    @property
    def inflight(self) -> int:
        """This ingress's jobs that can be running (at most `max_batch` per replica)."""
        return min(self.outstanding, (self._replicas or 1) * self.settings.max_batch)

    def retry_after(self) -> int:
        return self._retry_after

    # -- jobs -----------------------------------------------------------------------------------------
    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        pending = Pending(job, loop.create_future(), lane, asyncio.Queue() if job.stream else None)
        task = loop.create_task(self._run(pending), name=f"job-{job.request_id}")
        self.outstanding += 1
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        pending.future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        return pending

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.outstanding -= 1

    async def _run(self, pending: Pending) -> None:
        """Send the job to a replica (once more if that one dies) and settle `pending` with the outcome.

        An ingress that has not heard from a replica yet (Serve sends it requests as soon as the replicas exist,
        before its first poll came back) asks one now; only if none answers is the job refused (503). Once one
        has answered, jobs wait in the handle while Serve replaces replicas."""
        if self._state is None:
            await self._update_state()
            if self._state is None:
                _settle(pending, WorkerUnavailable("no engine replica is ready yet"))
                return
        delivered = 0  # progress messages handed on: a retry skips as many
        for attempt in range(RETRIES + 1):
            outcome, delivered = await self._attempt(pending, delivered, last=attempt == RETRIES)
            if outcome is not None:
                _settle(pending, outcome)
                return
            log.warning("job %s: its replica died or is going; sending it to another", pending.job.request_id)

    async def _attempt(
        self, pending: Pending, delivered: int, *, last: bool
    ) -> tuple[JobResult | Exception | None, int]:
        """One replica's try: the job's outcome (None: another replica should try), and the progress messages
        delivered by now."""
        stream: DeploymentResponseGenerator[Any] | None = None
        seen = 0
        try:
            response = self._stream.run.remote(pending.job, pending.lane)
            assert isinstance(response, DeploymentResponseGenerator)
            stream = response
            async for message in stream:
                if isinstance(message, Finished):
                    pending.dispatched = time.perf_counter() - message.running_s
                    return message.result, delivered
                if isinstance(message, Refused):
                    again = message.reason in ("unavailable", "shutting_down") and not last
                    return (None if again else self._refusal(message)), delivered
                seen += 1
                if seen > delivered and pending.progress is not None:
                    pending.progress.put_nowait(message)
                    delivered = seen
        except asyncio.CancelledError:
            if stream is not None:
                stream.cancel()  # the client left: the replica drops or stops the job
            raise
        except BackPressureError:  # the handle holds max_queued_requests already
            return QueueFull(self._retry_after), delivered
        except RayActorError as exc:
            died = WorkerUnavailable(f"the engine replica died while transcribing: {exc}")
            return (died if last else None), delivered
        except Exception as exc:
            log.exception("job %s failed on the cluster", pending.job.request_id)
            return WorkerUnavailable(f"the engine replica failed: {exc}"), delivered
        return WorkerUnavailable("the engine replica ended the job without a result"), delivered

    def _refusal(self, refused: Refused) -> Exception:
        if refused.reason == "queue_full":
            self._retry_after = refused.retry_after or self._retry_after
            return QueueFull(refused.retry_after)
        if refused.reason == "no_model":
            return NoUsableModel(refused.message)
        if refused.reason == "shutting_down":
            return WorkerUnavailable(f"the engine replica is shutting down: {refused.message}")
        return WorkerUnavailable(refused.message)

    async def close(self, timeout: float) -> None:
        """Stop accepting; wait up to `timeout` s for the jobs sent (the replicas drain themselves)."""
        self._closed = True
        deadline = time.monotonic() + timeout
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._tasks):
            task.cancel()
        if self.export is not None:
            self.export.stop()
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll


def _settle(pending: Pending, outcome: JobResult | Exception) -> None:
    if pending.future.done():
        return
    if isinstance(outcome, Exception):
        pending.future.set_exception(outcome)
    else:
        pending.future.set_result(outcome)
