"""The engine on this machine: one worker process (its supervisor) behind the laned queue (the batcher)."""

from __future__ import annotations

from collections.abc import Callable

from app.api.audio import SAMPLE_RATE
from app.server.memory import MB
from app.server.metrics import ServerMetrics
from app.server.worker.batcher import Batcher
from app.server.worker.budget import MemoryPlan
from app.server.worker.client import EngineHealth, Lane, Pending
from app.server.worker.protocol import BatchResult, Job, Ready
from app.server.worker.supervisor import WorkerSupervisor
from app.settings import Settings


def _label(value: str | int | bool | None) -> str:
    """A Prometheus label value: "" for unknown, "true"/"false" for flags."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class LocalWorker:
    """An `EngineClient` over a worker process of this machine; records the worker's and batches' metrics.

    `on_fatal(reason)` is called when the worker can never serve (it cannot load the models).
    """

    def __init__(
        self, settings: Settings, metrics: ServerMetrics, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.supervisor = WorkerSupervisor(
            settings, on_ready=self._on_ready, on_batch=self._on_batch, on_fatal=on_fatal
        )
        self.batcher = Batcher(
            self.supervisor,
            metrics,
            settings.max_batch,
            settings.batch_window_ms / 1000,
            settings.queue_size,
            settings.realtime_partial_max_wait_s,
            max_queued_samples=round(settings.max_queued_audio_seconds * SAMPLE_RATE),
            max_rows=max(settings.max_batch_rows, settings.max_batch),
            max_background=settings.long_upload_batch,
        )
        self.memory: MemoryPlan | None = None
        self.batch_peak_mb = 0.0  # the worker's highest resident peak over a batch since it started
        self.metrics.batch_clips_limit.set(settings.max_batch)

    def _on_ready(self, ready: Ready) -> None:
        self._plan(ready.memory)  # a restarted worker measures afresh
        self.batch_peak_mb = 0.0
        m = self.metrics
        m.worker_up.set(1)
        m.model_load_seconds.set(ready.load_seconds)
        m.engine.info({key: _label(value) for key, value in ready.engine.items()})
        m.mode_cost.clear()  # a restarted worker measures afresh

    def _on_batch(self, result: BatchResult) -> None:
        self.metrics.observe_batch(result.mode, result.costs())
        if result.peak_mb is not None:
            self.batch_peak_mb = max(self.batch_peak_mb, result.peak_mb)
            self.metrics.worker_batch_peak.set(self.batch_peak_mb * MB)
            if self.memory is not None:
                self._plan(self.memory.after_batch(len(result.results) + result.nested_clips, result.peak_mb))

    def _plan(self, plan: MemoryPlan | None) -> None:
        """The worker's memory plan now: the batcher holds batches to the clips it allows."""
        self.memory = plan
        self.batcher.memory_cap = None if plan is None else plan.batch
        if plan is not None:
            self.metrics.worker_memory_budget.set(plan.budget_mb * MB)
            self.metrics.batch_clips_limit.set(plan.batch)

    @property
    def depth(self) -> int:
        return self.batcher.depth

    @property
    def inflight(self) -> int:
        return self.batcher.inflight

    def health(self) -> EngineHealth:
        s = self.supervisor
        return EngineHealth(s.ready, s.is_ready, s.restarts, s.pid, s.failure, memory=self.memory)

    def retry_after(self) -> int:
        return self.batcher.retry_after()

    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        return self.batcher.submit(job, lane)

    async def start(self) -> None:
        self.supervisor.start()
        self.batcher.start()

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the worker is ready within `timeout` s (its models loaded and warmed up)."""
        return await self.supervisor.wait_ready(timeout)

    async def close(self, timeout: float) -> None:
        await self.batcher.drain(timeout)
        await self.supervisor.stop()
