"""Jobs into the engine and their results out, as the API's errors: the one place the serving layer meets the queue.

Uploads (whole or chunked) and live utterances alike go through `Jobs.submit` and `Jobs.result`: a job the
engine will not take is a 429 (its queue is full) or a 503 (no worker, shutting down); a job that waited longer
than `request_timeout_s` is a 504 and is dropped; a job whose client went away is dropped too.
"""

from __future__ import annotations

import asyncio

from app.api import errors
from app.api.types import Transcription
from app.server.worker.client import (
    EngineClient,
    Lane,
    NoUsableModel,
    Pending,
    QueueFull,
    ShuttingDown,
    WorkerUnavailable,
)
from app.server.worker.protocol import Job


class Jobs:
    def __init__(self, engine: EngineClient, request_timeout_s: float) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s

    @property
    def queued(self) -> bool:
        """Whether any job waits for the worker."""
        return self.engine.depth > 0

    def _refused(self, exc: QueueFull | WorkerUnavailable | ShuttingDown, when: str = "") -> errors.ApiError:
        """The answer to a job the engine would not take (429) or could not run (503)."""
        if isinstance(exc, QueueFull):
            return errors.queue_full(retry_after=exc.retry_after or self.engine.retry_after())
        if isinstance(exc, NoUsableModel):
            return errors.not_ready(str(exc), final=True)
        return errors.not_ready(f"{when}{exc}")

    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        try:
            return self.engine.submit(job, lane)
        except (QueueFull, WorkerUnavailable, ShuttingDown) as exc:
            raise self._refused(exc) from exc

    async def result(self, pending: Pending) -> tuple[Transcription, float]:
        """Wait for a submitted job: its transcription and the time it queued (ms)."""
        try:
            result = await asyncio.wait_for(asyncio.shield(pending.future), self.request_timeout_s)
        except TimeoutError as exc:
            pending.future.cancel()
            raise errors.timeout(self.request_timeout_s) from exc
        except asyncio.CancelledError:
            pending.future.cancel()  # the client went away: drop the queued work
            raise
        except (QueueFull, WorkerUnavailable, ShuttingDown) as exc:
            raise self._refused(exc, "Transcription failed: ") from exc
        if result.internal:
            raise errors.ApiError(500, result.error or "internal error", type="server_error", code="internal_error")
        if result.error is not None or result.transcription is None:
            raise errors.bad_request(result.error or "transcription failed")
        queue_ms = (pending.dispatched - pending.enqueued) * 1000 if pending.dispatched else 0.0
        return result.transcription, queue_ms

    async def run(self, job: Job, lane: Lane = Lane.UPLOAD) -> tuple[Transcription, float]:
        """`submit`, then `result`."""
        return await self.result(self.submit(job, lane))
