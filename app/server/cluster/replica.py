"""An engine replica: one `LocalWorker` (worker process + batcher) per Ray Serve replica, models resident.

The ingress sends it jobs through a deployment handle (`run`, streamed: progress, then the result); its
worker batches them as the standalone server's does, with the adaptive choice between speculative and
plain decoding. A replica is routable only once its models are loaded; Serve restarts one whose models
cannot load (`check_health`), and drains one it scales down (`__del__`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from app.api.types import Segment
from app.server.cluster.export import RayMetricsExport
from app.server.cluster.protocol import Finished, Refused, ReplicaState
from app.server.metrics import ServerMetrics
from app.server.worker.client import (
    Lane,
    NoUsableModel,
    QueueFull,
    ShuttingDown,
    WorkerUnavailable,
    progress_until,
)
from app.server.worker.local import LocalWorker
from app.server.worker.protocol import Job
from app.settings import Settings

log = logging.getLogger("specwhisper.cluster")


class EngineReplica:
    """The deployment's class (see `app.server.cluster.application` for its options)."""

    async def __init__(self, settings: Settings) -> None:  # type: ignore[misc]  # Serve awaits it
        self.settings = settings
        self.metrics = ServerMetrics()
        self.worker = LocalWorker(settings, self.metrics)
        await self.worker.start()
        if not await self.worker.wait_ready(settings.worker_start_timeout_s):
            health = self.worker.health()
            await self.worker.close(0)
            raise RuntimeError(f"the replica's worker is not ready: {health.failure or 'timed out'}")
        self.export = RayMetricsExport(self.metrics.registry)
        self.export.start()
        self._unready_since: float | None = None

    async def run(self, job: Job, lane: Lane) -> AsyncIterator[list[Segment] | Refused | Finished]:
        """Queue `job` in `lane`; yields its segments as they come (a streaming job), then Finished, or Refused.
        Cancelled by the caller (its client left), the job is dropped from the queue or stopped in the worker."""
        try:
            pending = self.worker.submit(job, lane)
        except QueueFull as exc:
            yield Refused("queue_full", str(exc), exc.retry_after)
            return
        except (WorkerUnavailable, ShuttingDown) as exc:
            yield _refused(exc)
            return
        try:
            if pending.progress is not None:
                async for segments in progress_until(pending.progress, pending.future):
                    yield segments
            result = await pending.future
            yield Finished(result, time.perf_counter() - pending.dispatched if pending.dispatched else 0.0)
        except (WorkerUnavailable, ShuttingDown) as exc:
            yield _refused(exc)
        finally:
            if not pending.future.done():
                pending.future.cancel()

    def state(self) -> ReplicaState:
        return ReplicaState(self.worker.health(), self.worker.depth, self.worker.inflight)

    def check_health(self) -> None:
        """Serve's health check (every few seconds): it fails, and Serve replaces the replica, when the worker
        can no longer load its models, or has not been ready for `worker_start_timeout_s` (a worker that keeps
        crashing is restarted by its supervisor with growing delays; a new replica may fare better)."""
        health = self.worker.health()
        if health.failure is not None:
            raise RuntimeError(f"the worker cannot load the models: {health.failure}")
        now = time.monotonic()
        if health.is_ready:
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = now
        elif now - self._unready_since > self.settings.worker_start_timeout_s:
            raise RuntimeError(f"the worker has not been ready for {now - self._unready_since:.0f} s")

    async def __del__(self) -> None:
        """Serve scales this replica down or replaces it: finish queued and running work, then stop the worker."""
        export, worker = getattr(self, "export", None), getattr(self, "worker", None)  # a constructor may have failed
        if export is not None:
            export.stop()
        if worker is not None:
            log.info("replica stopping: draining (up to %.0f s)", self.settings.shutdown_timeout_s)
            await worker.close(self.settings.shutdown_timeout_s)


def _refused(exc: WorkerUnavailable | ShuttingDown) -> Refused:
    if isinstance(exc, NoUsableModel):
        return Refused("no_model", str(exc))
    if isinstance(exc, ShuttingDown):
        return Refused("shutting_down", str(exc))
    return Refused("unavailable", str(exc))
