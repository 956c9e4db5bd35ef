"""The serving layer: the one service that uploads (REST, SSE) and live sessions (realtime) go through.

An upload is validated (`requests.py`), its audio read in bounded steps on the upload threads (`uploads.py`,
`admission.FairShare`), admitted to the budget of audio in flight (`admission.AudioBudget`), queued in its lane,
and its answer shaped and recorded (`replies.py`). Live sessions are admitted here too (their number is limited).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, AudioTooLongError, EncodedAudio
from app.api.types import DecodingOptions, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.admission import Account, AudioBudget, FairShare, OverBudget
from app.server.serving.chunking import CHUNK_SECONDS, Chunk, merge
from app.server.serving.models import ModelNames
from app.server.serving.replies import Replies, Reply, delta_event, done_event
from app.server.serving.requests import RequestRules, TranscriptionRequest
from app.server.serving.uploads import STEP_SAMPLES, AudioScan, Chunking, ChunkScan, chunk_results
from app.server.vad import SileroVad
from app.server.worker.client import (
    EngineClient,
    Lane,
    NoUsableModel,
    Pending,
    QueueFull,
    ShuttingDown,
    WorkerUnavailable,
    progress_until,
)
from app.server.worker.protocol import Job
from app.settings import Settings

T = TypeVar("T")

NON_AUDIO_TYPES = ("text/", "image/", "application/json", "application/xml", "application/pdf")
SHORT_UPLOAD_S = 60.0  # an upload this short passes uploads waiting for the audio budget, when it fits
SHORT_RESERVE_UPLOADS = 4  # short uploads' own room past the audio budget: this many of SHORT_UPLOAD_S


@dataclass(frozen=True)
class Upload:
    """An admitted upload: its bytes, its first pass (length, loudness) and its use of the upload threads."""

    audio: EncodedAudio
    scan: AudioScan
    account: Account

    @property
    def long(self) -> bool:
        """Longer than SHORT_UPLOAD_S: its jobs are `background`, a short upload's go first."""
        return self.scan.seconds > SHORT_UPLOAD_S


def _merged(
    parts: Sequence[tuple[Chunk, Transcription, float]], upload: Upload, options: DecodingOptions
) -> Transcription:
    """A chunked upload's transcription, from its chunks', in order."""
    return merge([c for c, _, _ in parts], [t for _, t, _ in parts], upload.scan.seconds, options.language)


class HeldEvents:
    """A streamed answer's events, with the upload's places (the audio budget, the upload threads) given back once
    they end, fail or are closed (`aclose`, which the route runs after the response, even if the client left
    before the first event was read: an async generator never started would never run its `finally`)."""

    def __init__(
        self,
        events: AsyncIterator[dict[str, Any]],
        admitted: AbstractAsyncContextManager[Any],
        pending: Pending | None = None,
    ) -> None:
        self._events = events
        self._admitted: AbstractAsyncContextManager[Any] | None = admitted
        self._pending = pending  # its job, dropped if it has not finished by then

    def __aiter__(self) -> HeldEvents:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self._events.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        admitted, self._admitted = self._admitted, None
        if admitted is None:
            return
        try:
            if self._pending is not None and not self._pending.future.done():
                self._pending.future.cancel()
            closing = getattr(self._events, "aclose", None)
            if closing is not None:
                await closing()
        finally:
            await admitted.__aexit__(None, None, None)


class TooManySessions(Exception):
    """`realtime_max_sessions` live sessions are open already."""


class TranscriptionService:
    def __init__(self, settings: Settings, engine: EngineClient, metrics: ServerMetrics, vad: SileroVad) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.vad = vad
        self.models = ModelNames(settings)
        self.model_id = self.models.served
        self.rules = RequestRules(settings, self.models)
        self.replies = Replies(metrics)
        self.share = FairShare(settings.upload_threads)
        self.budget = AudioBudget(
            settings.max_audio_in_flight_s,
            SHORT_UPLOAD_S,
            self._budget_changed,
            reserve=SHORT_RESERVE_UPLOADS * SHORT_UPLOAD_S,
        )
        self.live_sessions = 0

    def close(self) -> None:
        self.share.close()

    def _budget_changed(self) -> None:
        self.metrics.audio_in_flight.set(self.budget.held)
        self.metrics.budget_waiting.set(self.budget.waiting)

    def chunked_hold_s(self) -> float:
        """What a chunked upload holds at most, in seconds of audio: the chunks being transcribed, a step's block
        and the chunks it may settle, the follower's blocks."""
        return self.settings.max_batch * CHUNK_SECONDS + 3 * STEP_SAMPLES / SAMPLE_RATE

    # -- live (realtime) transcription -------------------------------------------------------------
    def live_options(self, model: str, language: str | None, prompt: str | None) -> DecodingOptions:
        return self.rules.live_options(model, language, prompt)

    @contextmanager
    def live_session(self) -> Iterator[None]:
        """Hold one of the `realtime_max_sessions` places for a live session; TooManySessions when none is free."""
        if self.live_sessions >= self.settings.realtime_max_sessions:
            raise TooManySessions
        self.live_sessions += 1
        self.metrics.realtime_sessions.set(self.live_sessions)
        try:
            yield
        finally:
            self.live_sessions -= 1
            self.metrics.realtime_sessions.set(self.live_sessions)

    async def transcribe_live(
        self, audio: np.ndarray, options: DecodingOptions, *, final: bool
    ) -> tuple[Transcription, float]:
        """Transcribe a live utterance: a `final` one in the first lane, a partial (an utterance still spoken)
        in the last. Returns the transcription and the time it queued (ms); ApiError when it cannot run."""
        lane = Lane.LIVE_FINAL if final else Lane.LIVE_PARTIAL
        transcription, queue_ms = await self.result(self.submit(Job(f"rt_{uuid.uuid4().hex}", audio, options), lane))
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
        return self.engine.depth > 0

    def early_final(self, used: bool) -> None:
        """Count a live final begun at a pause: `used` as the utterance's final, or dropped."""
        self.metrics.realtime_early_finals.labels(outcome="used" if used else "dropped").inc()

    def live_error(self, code: str) -> None:
        """Count an error event sent to a live client."""
        self.metrics.realtime_errors.labels(code=code).inc()

    # -- the queue ------------------------------------------------------------------------------------
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
            result = await asyncio.wait_for(asyncio.shield(pending.future), self.settings.request_timeout_s)
        except TimeoutError as exc:
            pending.future.cancel()
            raise errors.timeout(self.settings.request_timeout_s) from exc
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

    # -- uploads ---------------------------------------------------------------------------------------
    async def transcribe(self, req: TranscriptionRequest, request_id: str | None = None) -> Reply:
        started = time.perf_counter()
        request_id = request_id or uuid.uuid4().hex
        options, chunking = self.rules.options(req), self.rules.chunking(req)
        async with self._admitted(req, chunking) as upload:
            if chunking is not None:
                results = self._chunk_results(request_id, upload, options, chunking)
                async with self._audio_errors(req), aclosing(results) as chunks:
                    parts = [part async for part in chunks]
                queue_ms = parts[0][2] if parts else 0.0
                transcription = _merged(parts, upload, options)
            else:
                job = Job(request_id, upload.audio, options, samples=upload.scan.samples, background=upload.long)
                transcription, queue_ms = await self.result(self.submit(job))
        return self.replies.reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)

    async def transcribe_stream(self, req: TranscriptionRequest, request_id: str | None = None) -> HeldEvents:
        """Validate the request and read its audio now (errors raise here), then return its events, its place in
        the audio budget held until they end or are closed: `transcript.text.delta` per segment as windows (or chunks)
        complete, then `transcript.text.done`."""
        started = time.perf_counter()
        request_id = request_id or uuid.uuid4().hex
        options, chunking = self.rules.options(req), self.rules.chunking(req)
        admitted = self._admitted(req, chunking)
        upload = await admitted.__aenter__()
        try:
            if chunking is not None:
                return HeldEvents(self._chunked_events(req, request_id, upload, options, chunking, started), admitted)
            job = Job(
                request_id, upload.audio, options, stream=True, samples=upload.scan.samples, background=upload.long
            )
            pending = self.submit(job)
        except BaseException as exc:
            await admitted.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return HeldEvents(self._events(req, pending, started), admitted, pending)

    @asynccontextmanager
    async def _admitted(self, req: TranscriptionRequest, chunking: Chunking | None) -> AsyncIterator[Upload]:
        """The upload's audio, checked whole (`AudioScan`, on the upload threads), while it holds its place in
        the audio budget: ApiError 400/413/415 for bad audio, 429 when the budget's line is full."""
        if len(req.data) > self.settings.max_upload_bytes:
            raise errors.too_large(self.settings.max_upload_bytes)
        if not req.data:
            raise errors.bad_request("The audio file is empty.", param="file", code="empty_file")
        audio = EncodedAudio(req.data, self.settings.max_audio_seconds)
        scan = AudioScan(audio, levels=chunking is not None and chunking.normalize)
        account = self.share.account()
        async with self._audio_errors(req):
            try:
                while not scan.done:
                    await self.share.run(account, scan.step)
            finally:
                self.share.leave(account)  # not while it waits for the budget: the budget's holders need it
        hold = scan.seconds if chunking is None else min(scan.seconds, self.chunked_hold_s())
        try:
            async with self.budget.hold(hold, self.engine.retry_after):
                try:
                    yield Upload(audio, scan, account)
                finally:
                    self.share.leave(account)
        except OverBudget as exc:
            self.metrics.budget_refused.inc()
            raise errors.queue_full(exc.retry_after) from exc

    @asynccontextmanager
    async def _audio_errors(self, req: TranscriptionRequest) -> AsyncIterator[None]:
        """AudioError as the ApiError the client gets: 400 (415 where the upload says it is not audio)."""
        try:
            yield
        except AudioTooLongError as exc:
            raise errors.bad_request(str(exc), param="file", code="audio_too_long") from exc
        except AudioError as exc:
            if req.content_type and req.content_type.startswith(NON_AUDIO_TYPES):
                raise errors.unsupported_media(f"Unsupported media type {req.content_type}: {exc}") from exc
            raise errors.bad_request(
                f"Could not decode the audio file: {exc}", param="file", code="invalid_audio"
            ) from exc

    def _chunk_results(
        self,
        request_id: str,
        upload: Upload,
        options: DecodingOptions,
        chunking: Chunking,
    ) -> AsyncGenerator[tuple[Chunk, Transcription, float], None]:
        """The upload's chunks with their transcriptions and queue times, in order (`uploads.chunk_results`)."""
        finder = functools.partial(self.vad.finder, chunking.params, CHUNK_SECONDS)
        chunks = ChunkScan(upload.audio, finder, upload.scan.gain)

        def run(step: Callable[[], T]) -> Any:
            return self.share.run(upload.account, step)

        def transcribe(k: int, samples: np.ndarray) -> Any:
            return self.result(self.submit(Job(f"{request_id}-{k}", samples, options, turn=k, background=upload.long)))

        idle = functools.partial(self.share.leave, upload.account)  # its long place, while it waits for the worker
        return chunk_results(chunks, run, transcribe, self.settings.max_batch, idle)

    async def _chunked_events(
        self,
        req: TranscriptionRequest,
        request_id: str,
        upload: Upload,
        options: DecodingOptions,
        chunking: Chunking,
        started: float,
    ) -> AsyncIterator[dict[str, Any]]:
        """`transcript.text.delta` per chunk, in order, then `transcript.text.done`."""
        parts: list[tuple[Chunk, Transcription, float]] = []
        sent = False
        try:
            results = self._chunk_results(request_id, upload, options, chunking)
            async with self._audio_errors(req), aclosing(results) as chunks:
                async for part in chunks:
                    parts.append(part)
                    segments = part[1].segments
                    text = "".join(s.text for s in segments)  # as `merge` joins them
                    delta = text if sent else text.lstrip()
                    if delta.strip():
                        yield delta_event(req, delta, segments)
                        sent = True
        except errors.ApiError as exc:
            yield {"type": "error", **exc.body()}
            return
        transcription = _merged(parts, upload, options)
        total_ms = (time.perf_counter() - started) * 1000
        reply = self.replies.reply(req, transcription, parts[0][2] if parts else 0.0, total_ms)
        yield done_event(req, transcription, reply.metrics)

    async def _events(
        self, req: TranscriptionRequest, pending: Pending, started: float
    ) -> AsyncIterator[dict[str, Any]]:
        progress = pending.progress
        assert progress is not None
        outcome = asyncio.ensure_future(self.result(pending))
        sent = ""
        try:
            async for segments in progress_until(progress, outcome):
                delta = "".join(s.text for s in segments)
                delta = delta if sent else delta.lstrip()
                if delta:
                    sent += delta
                    yield delta_event(req, delta, segments)
            try:
                transcription, queue_ms = await outcome
            except errors.ApiError as exc:
                yield {"type": "error", **exc.body()}
                return
            text, confirmed = transcription.text, sent.strip()
            if text != confirmed and text.startswith(confirmed):
                yield delta_event(req, text[len(confirmed) :], [])
            reply = self.replies.reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)
            yield done_event(req, transcription, reply.metrics)
        finally:
            if not outcome.done():
                outcome.cancel()
