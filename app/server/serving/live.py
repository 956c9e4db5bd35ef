"""Live (realtime) sessions' side of the serving layer: their places, their utterances' jobs and their metrics."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from app.api.types import DecodingOptions, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.jobs import Jobs
from app.server.serving.replies import Replies
from app.server.serving.requests import RequestRules
from app.server.vad import SileroVad
from app.server.worker.client import Lane
from app.server.worker.protocol import Job, PrintRequest
from app.settings import Settings


class TooManySessions(Exception):
    """`realtime_max_sessions` live sessions are open already."""


class LiveService:
    """What a realtime session asks of the server: a place (`live_session`), its utterances transcribed in the live
    lanes (`transcribe_live`), the VAD, and its counters recorded."""

    def __init__(
        self,
        settings: Settings,
        jobs: Jobs,
        metrics: ServerMetrics,
        vad: SileroVad,
        rules: RequestRules,
        replies: Replies,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.metrics = metrics
        self.vad = vad
        self.rules = rules
        self.replies = replies
        self.model_id = rules.models.served
        self.sessions = 0

    def live_options(self, model: str, language: str | None, prompt: str | None) -> DecodingOptions:
        return self.rules.live_options(model, language, prompt)

    @contextmanager
    def live_session(self) -> Iterator[None]:
        """Hold one of the `realtime_max_sessions` places for a live session; TooManySessions when none is free."""
        if self.sessions >= self.settings.realtime_max_sessions:
            raise TooManySessions
        self.sessions += 1
        self.metrics.realtime_sessions.set(self.sessions)
        try:
            yield
        finally:
            self.sessions -= 1
            self.metrics.realtime_sessions.set(self.sessions)

    async def transcribe_live(
        self, audio: np.ndarray, options: DecodingOptions, *, final: bool, prints: bool = False
    ) -> tuple[Transcription, float]:
        """Transcribe a live utterance: a `final` one in the first lane, a partial (an utterance still spoken)
        in the last; with `prints`, its voice prints too (the whole utterance is its speech). Returns the
        transcription and the time it queued (ms); ApiError when it cannot run."""
        lane = Lane.LIVE_FINAL if final else Lane.LIVE_PARTIAL
        voices = PrintRequest(((0, audio.size),)) if prints else None
        job = Job(f"rt_{uuid.uuid4().hex}", audio, options, prints=voices)
        transcription, queue_ms = await self.jobs.run(job, lane)
        if not final:
            self.metrics.realtime_partials.inc()
            m = transcription.metrics  # partials are work too: count their tokens and drafts
            self.metrics.tokens.inc(m.tokens)
            self.metrics.draft_proposed.inc(m.draft_proposed)
            self.metrics.draft_accepted.inc(m.draft_accepted)
        return transcription, queue_ms

    def utterance_metrics(self, t: Transcription, queue_ms: float, latency_s: float) -> dict[str, Any]:
        """The `metrics` of a completed live utterance (`latency_ms`: its last audio to now); also recorded."""
        self.metrics.utterance_latency.observe(latency_s)
        return {**self.replies.request_metrics(t, queue_ms, latency_s * 1000), "latency_ms": round(latency_s * 1000, 2)}

    @property
    def work_queued(self) -> bool:
        """Whether any job waits for the worker (a live partial, best effort, would only delay it)."""
        return self.jobs.queued

    def early_final(self, used: bool) -> None:
        """Count a live final begun at a pause: `used` as the utterance's final, or dropped."""
        self.metrics.realtime_early_finals.labels(outcome="used" if used else "dropped").inc()

    def live_error(self, code: str) -> None:
        """Count an error event sent to a live client."""
        self.metrics.realtime_errors.labels(code=code).inc()
