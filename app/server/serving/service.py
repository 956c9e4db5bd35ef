"""The serving layer: the one service that uploads (REST, SSE) and live sessions (realtime) go through.

It validates a request, decodes its audio off the event loop, queues it in its lane, waits for the worker,
shapes the answer and records it in the metrics; it also admits live sessions (their number is limited).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.api import errors
from app.api.audio import AudioError, AudioTooLongError, decode_audio
from app.api.formats import FORMATS, to_srt, to_verbose_json, to_vtt
from app.api.types import DecodingOptions, InvalidRequestError, Transcription
from app.server.metrics import ServerMetrics
from app.server.worker.batcher import Batcher, Lane, Pending, QueueFull, ShuttingDown
from app.server.worker.protocol import Job
from app.server.worker.supervisor import NoUsableModel, WorkerUnavailable
from app.settings import Settings

NON_AUDIO_TYPES = ("text/", "image/", "application/json", "application/xml", "application/pdf")


@dataclass(frozen=True)
class TranscriptionRequest:
    """The form fields of `/v1/audio/transcriptions` and `/translations`, as received."""

    data: bytes
    filename: str | None
    content_type: str | None
    model: str
    task: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    timestamp_granularities: tuple[str, ...] = ()
    speculative: bool = True
    stream: bool = False


@dataclass(frozen=True)
class Reply:
    body: str
    media_type: str
    metrics: dict[str, Any]


class TooManySessions(Exception):
    """`realtime_max_sessions` live sessions are open already."""


class TranscriptionService:
    def __init__(self, settings: Settings, batcher: Batcher, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.batcher = batcher
        self.metrics = metrics
        self.model_id = settings.served_model_name or settings.model.rstrip("/").split("/")[-1]
        self.live_sessions = 0

    @property
    def model_ids(self) -> list[str]:
        return [self.model_id, *[a for a in self.settings.model_aliases if a != self.model_id]]

    def _options(self, req: TranscriptionRequest) -> DecodingOptions:
        self._check_model(req.model)
        if req.response_format not in FORMATS:
            raise errors.bad_request(f"response_format must be one of {', '.join(FORMATS)}", param="response_format")
        granularities = set(req.timestamp_granularities)
        if not granularities <= {"segment", "word"}:
            raise errors.bad_request(
                "timestamp_granularities must be 'segment' and/or 'word'", param="timestamp_granularities[]"
            )
        if req.stream and (granularities or req.response_format not in ("json", "text")):
            raise errors.bad_request(
                "stream=true streams text: use response_format json or text, without timestamps", param="stream"
            )
        if granularities and req.response_format != "verbose_json":
            raise errors.bad_request(
                "timestamp_granularities requires response_format=verbose_json", param="timestamp_granularities[]"
            )
        timestamps = "word" if "word" in granularities else "none"
        if timestamps == "none" and req.response_format in ("srt", "vtt", "verbose_json"):
            timestamps = "segment"
        return self._decoding_options(req.task, req.language, req.prompt, req.temperature, timestamps, req.speculative)

    def _check_model(self, model: str) -> None:
        if model not in self.model_ids:
            raise errors.model_not_found(model)

    def _decoding_options(
        self,
        task: str,
        language: str | None,
        prompt: str | None,
        temperature: float = 0.0,
        timestamps: str = "none",
        speculative: bool = True,
    ) -> DecodingOptions:
        """The engine's options for a request of either kind (upload or live), its model checked already;
        ApiError if they are invalid."""
        if not 0.0 <= temperature <= 1.0:
            raise errors.bad_request("temperature must be between 0 and 1", param="temperature")
        language = language.strip().lower() if language else None
        try:
            return DecodingOptions(
                language=language or None,
                task=task,
                use_assistant=speculative,
                timestamps=timestamps,  # type: ignore[arg-type]
                prompt=prompt or None,
                temperature=temperature,
            )
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc)) from exc

    async def _audio(self, req: TranscriptionRequest) -> Any:
        if len(req.data) > self.settings.max_upload_bytes:
            raise errors.too_large(self.settings.max_upload_bytes)
        if not req.data:
            raise errors.bad_request("The audio file is empty.", param="file", code="empty_file")
        try:
            return await asyncio.to_thread(decode_audio, req.data, self.settings.max_audio_seconds)
        except AudioTooLongError as exc:
            raise errors.bad_request(str(exc), param="file", code="audio_too_long") from exc
        except AudioError as exc:
            if req.content_type and req.content_type.startswith(NON_AUDIO_TYPES):
                raise errors.unsupported_media(f"Unsupported media type {req.content_type}: {exc}") from exc
            raise errors.bad_request(
                f"Could not decode the audio file: {exc}", param="file", code="invalid_audio"
            ) from exc

    # -- live (realtime) transcription -------------------------------------------------------------
    def live_options(self, model: str, language: str | None, prompt: str | None) -> DecodingOptions:
        """Options of a live transcription: greedy, no timestamps; ApiError if they are invalid."""
        self._check_model(model)
        return self._decoding_options("transcribe", language, prompt)

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
        return {**self.request_metrics(t, queue_ms, latency_s * 1000), "latency_ms": round(latency_s * 1000, 2)}

    def live_error(self, code: str) -> None:
        """Count an error event sent to a live client."""
        self.metrics.realtime_errors.labels(code=code).inc()

    # -- the queue ------------------------------------------------------------------------------------
    def submit(self, job: Job, lane: Lane = Lane.UPLOAD) -> Pending:
        try:
            return self.batcher.submit(job, lane)
        except QueueFull as exc:
            raise errors.queue_full(retry_after=self.batcher.retry_after()) from exc
        except NoUsableModel as exc:
            raise errors.not_ready(str(exc), final=True) from exc
        except (WorkerUnavailable, ShuttingDown) as exc:
            raise errors.not_ready(str(exc)) from exc

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
        except (WorkerUnavailable, ShuttingDown) as exc:
            raise errors.not_ready(f"Transcription failed: {exc}") from exc
        if result.internal:
            raise errors.ApiError(500, result.error or "internal error", type="server_error", code="internal_error")
        if result.error is not None or result.transcription is None:
            raise errors.bad_request(result.error or "transcription failed")
        queue_ms = (pending.dispatched - pending.enqueued) * 1000 if pending.dispatched else 0.0
        return result.transcription, queue_ms

    async def transcribe(self, req: TranscriptionRequest, request_id: str | None = None) -> Reply:
        started = time.perf_counter()
        options = self._options(req)
        audio = await self._audio(req)
        pending = self.submit(Job(request_id or uuid.uuid4().hex, audio, options))
        transcription, queue_ms = await self.result(pending)
        return self._reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)

    async def transcribe_stream(
        self, req: TranscriptionRequest, request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Validate and queue the request now (errors raise here), then return its events:
        `transcript.text.delta` per segment as windows complete, then `transcript.text.done`."""
        started = time.perf_counter()
        options = self._options(req)
        audio = await self._audio(req)
        pending = self.submit(Job(request_id or uuid.uuid4().hex, audio, options, stream=True))
        return self._events(req, pending, started)

    async def _events(
        self, req: TranscriptionRequest, pending: Pending, started: float
    ) -> AsyncIterator[dict[str, Any]]:
        progress = pending.progress
        assert progress is not None
        outcome = asyncio.ensure_future(self.result(pending))
        sent = ""
        try:
            while not (outcome.done() and progress.empty()):
                if progress.empty():
                    arrival = asyncio.ensure_future(progress.get())
                    await asyncio.wait({arrival, outcome}, return_when=asyncio.FIRST_COMPLETED)
                    if not arrival.done():
                        arrival.cancel()
                        continue
                    segments = arrival.result()
                else:
                    segments = progress.get_nowait()
                delta = "".join(s.text for s in segments)
                delta = delta if sent else delta.lstrip()
                if delta:
                    sent += delta
                    yield {"type": "transcript.text.delta", "delta": delta}
            try:
                transcription, queue_ms = await outcome
            except errors.ApiError as exc:
                yield {"type": "error", **exc.body()}
                return
            text, confirmed = transcription.text, sent.strip()
            if text != confirmed and text.startswith(confirmed):
                yield {"type": "transcript.text.delta", "delta": text[len(confirmed) :]}
            reply = self._reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)
            yield {"type": "transcript.text.done", "text": text, "metrics": reply.metrics}
        finally:
            if not outcome.done():
                outcome.cancel()

    def request_metrics(self, t: Transcription, queue_ms: float, total_ms: float) -> dict[str, Any]:
        """The `metrics` object of a response; also recorded in Prometheus."""
        m = t.metrics
        metrics = {
            "queue_ms": round(queue_ms, 2),
            "encode_ms": m.encode_ms,
            "decode_ms": m.decode_ms,
            "total_ms": round(total_ms, 2),
            "audio_seconds": m.audio_seconds,
            "tokens": m.tokens,
            "drafted": m.draft_proposed,
            "accepted": m.draft_accepted,
            "acceptance_rate": m.acceptance_rate,
            "tokens_per_main_pass": m.tokens_per_main_pass,
            "batch_size": m.batch_size,
            "real_time_factor": round(total_ms / 1000 / m.audio_seconds, 4) if m.audio_seconds else 0.0,
            "speculative": m.speculative,
        }
        self._observe(metrics)
        return metrics

    def _reply(self, req: TranscriptionRequest, t: Transcription, queue_ms: float, total_ms: float) -> Reply:
        metrics = self.request_metrics(t, queue_ms, total_ms)
        fmt = req.response_format
        if fmt == "text":
            return Reply(t.text + "\n", "text/plain; charset=utf-8", metrics)
        if fmt == "srt":
            return Reply(to_srt(t), "text/plain; charset=utf-8", metrics)
        if fmt == "vtt":
            return Reply(to_vtt(t), "text/vtt; charset=utf-8", metrics)
        if fmt == "verbose_json":
            body = to_verbose_json(t, req.task, words="word" in req.timestamp_granularities)
        else:
            body = {"text": t.text}
        body["metrics"] = metrics
        return Reply(json.dumps(body, ensure_ascii=False), "application/json", metrics)

    def _observe(self, m: dict[str, Any]) -> None:
        self.metrics.queue_seconds.observe(m["queue_ms"] / 1000)
        self.metrics.encode_seconds.observe(m["encode_ms"] / 1000)
        self.metrics.decode_seconds.observe(m["decode_ms"] / 1000)
        self.metrics.total_seconds.observe(m["total_ms"] / 1000)
        self.metrics.audio_seconds.inc(m["audio_seconds"])
        self.metrics.tokens.inc(m["tokens"])
        self.metrics.draft_proposed.inc(m["drafted"])
        self.metrics.draft_accepted.inc(m["accepted"])
