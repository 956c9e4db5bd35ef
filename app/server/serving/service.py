"""The serving layer: the one service that uploads (REST, SSE) and live sessions (realtime) go through.

It validates a request, decodes its audio off the event loop, queues it in its lane, waits for the worker,
shapes the answer and records it in the metrics; it also admits live sessions (their number is limited).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, AudioTooLongError, decode_audio
from app.api.formats import FORMATS, to_srt, to_verbose_json, to_vtt
from app.api.types import FALLBACK_TEMPERATURES, DecodingOptions, InvalidRequestError, Segment, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.chunking import CHUNK_SECONDS, Chunk, merge, normalized, plan
from app.server.serving.models import ModelNames
from app.server.vad import SileroVad, VadParams, server_vad
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

NON_AUDIO_TYPES = ("text/", "image/", "application/json", "application/xml", "application/pdf")
# A `server_vad` object's defaults: OpenAI's for chunking (a 200-ms pause ends speech).
UPLOAD_VAD = VadParams(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=200)
# "auto": only pauses of 2 s or more are left out, with 400 ms kept on each side (faster-whisper's VAD defaults).
# On `bench-audio`'s 10-minute file it kept WER at the sequential long-form's (0.173 against 0.176, where
# 200/300 gave 0.191), for 1.2x the speed of sequential instead of 1.4x.
AUTO_VAD = VadParams(threshold=0.5, prefix_padding_ms=400, silence_duration_ms=2000)


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
    # "auto", "none", a `server_vad` object, or its JSON; None: as the operator's `default_chunking_strategy`
    chunking_strategy: str | dict[str, Any] | None = None
    # openai-whisper's transcribe() options, beam search's included (OpenAI's API has none of them), as sent
    long_form: dict[str, str] = field(default_factory=dict)
    include: tuple[str, ...] = ()  # "logprobs": each text token's log-probability in the answer

    @property
    def logprobs(self) -> bool:
        return "logprobs" in self.include


# openai-whisper's `transcribe()` options an upload may set (form fields of the same names).
LONG_FORM_FIELDS = (
    "condition_on_previous_text",
    "compression_ratio_threshold",
    "logprob_threshold",
    "no_speech_threshold",
    "hallucination_silence_threshold",
    "clip_timestamps",
    "beam_size",
    "best_of",
    "patience",
    "length_penalty",
)
_INTEGER_FIELDS = ("beam_size", "best_of")


@dataclass(frozen=True)
class Chunking:
    """How an upload is cut into chunks by the VAD (`normalize`: level its loudness for the VAD first)."""

    params: VadParams
    normalize: bool


@dataclass(frozen=True)
class Reply:
    body: str
    media_type: str
    metrics: dict[str, Any]


def _long_form(raw: dict[str, str]) -> dict[str, Any]:
    """The `transcribe()` options of an upload's form fields; ApiError naming the field if one is invalid.
    A threshold of "none" (or "null") turns that check off."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        text = value.strip()
        try:
            if name == "condition_on_previous_text":
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[name] = text.lower() in ("true", "1")
            elif name == "clip_timestamps":
                out[name] = tuple(float(t) for t in text.split(",") if t.strip())
            elif name in _INTEGER_FIELDS:
                out[name] = int(text)
            elif text.lower() in ("none", "null"):
                out[name] = None
            else:
                out[name] = float(text)
                if not np.isfinite(out[name]):
                    raise ValueError
        except ValueError:
            kind = {"condition_on_previous_text": "true or false", "clip_timestamps": "comma-separated seconds"}
            kind |= dict.fromkeys(_INTEGER_FIELDS, "a whole number")
            raise errors.bad_request(
                f"{name} must be {kind.get(name, 'a number or none')}, got {value[:40]!r}", param=name
            ) from None
    return out


def _merged(
    parts: Sequence[tuple[Chunk, Transcription, float]], audio: np.ndarray, options: DecodingOptions
) -> Transcription:
    """A chunked upload's transcription, from its chunks', in order."""
    return merge([c for c, _, _ in parts], [t for _, t, _ in parts], audio.size / SAMPLE_RATE, options.language)


def _delta(req: TranscriptionRequest, delta: str, segments: Sequence[Segment]) -> dict[str, Any]:
    """A `transcript.text.delta` event: the new text, and its tokens' log-probabilities when asked for."""
    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
    if req.logprobs:
        event["logprobs"] = [p.to_dict() for s in segments for p in s.logprobs]
    return event


def _done(req: TranscriptionRequest, t: Transcription, metrics: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "transcript.text.done", "text": t.text}
    if req.logprobs:
        event["logprobs"] = [p.to_dict() for p in t.logprobs]
    return {**event, "metrics": metrics}


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
        self.live_sessions = 0

    def _options(self, req: TranscriptionRequest) -> DecodingOptions:
        self.models.check(req.model)
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
        if not set(req.include) <= {"logprobs"}:
            raise errors.bad_request("include[] may only be 'logprobs'", param="include[]")
        if req.logprobs and req.response_format not in ("json", "verbose_json"):
            raise errors.bad_request(
                "include[]=logprobs needs response_format json (or verbose_json)", param="include[]"
            )
        if granularities and req.response_format != "verbose_json":
            raise errors.bad_request(
                "timestamp_granularities requires response_format=verbose_json", param="timestamp_granularities[]"
            )
        timestamps = "word" if "word" in granularities else "none"
        if timestamps == "none" and req.response_format in ("srt", "vtt", "verbose_json"):
            timestamps = "segment"
        options = self._decoding_options(
            req.task, req.language, req.prompt, req.temperature, timestamps, req.speculative
        )
        # temperature 0 means OpenAI's fallback: greedy first, then hotter while a window fails the thresholds
        ladder = FALLBACK_TEMPERATURES if req.temperature == 0 else (req.temperature,)
        decoding = {"beam_size": self.settings.default_beam_size} | _long_form(req.long_form)
        try:
            return replace(options, temperature=ladder, **decoding)
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc), param=exc.param) from exc

    def _chunking(self, req: TranscriptionRequest) -> Chunking | None:
        """The request's `chunking_strategy` (else the operator's default); ApiError if it is invalid."""
        raw = req.chunking_strategy if req.chunking_strategy is not None else self.settings.default_chunking_strategy
        if isinstance(raw, str) and raw.strip().startswith("{"):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise errors.bad_request(
                    f"chunking_strategy is not valid JSON: {exc}", param="chunking_strategy"
                ) from exc
        if raw == "none":
            return None
        if "clip_timestamps" in req.long_form:  # times of the upload, which chunks do not keep
            raise errors.bad_request(
                "clip_timestamps cannot be combined with chunking_strategy", param="clip_timestamps"
            )
        if raw == "auto":
            return Chunking(AUTO_VAD, normalize=True)
        if not isinstance(raw, dict):
            raise errors.bad_request(
                "chunking_strategy must be 'auto', 'none' or a server_vad object", param="chunking_strategy"
            )
        try:
            params = server_vad(raw, "chunking_strategy", UPLOAD_VAD)
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc), param=exc.param) from exc
        assert params is not None
        return Chunking(params, normalize=False)

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
        self.models.check(model)
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

    async def transcribe(self, req: TranscriptionRequest, request_id: str | None = None) -> Reply:
        started = time.perf_counter()
        options = self._options(req)
        chunking = self._chunking(req)
        audio = await self._audio(req)
        request_id = request_id or uuid.uuid4().hex
        if chunking is not None:
            async with aclosing(self._chunk_results(request_id, audio, options, chunking)) as results:
                parts = [part async for part in results]
            queue_ms = parts[0][2] if parts else 0.0
            transcription = _merged(parts, audio, options)
        else:
            transcription, queue_ms = await self.result(self.submit(Job(request_id, audio, options)))
        return self._reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)

    # -- chunked uploads -------------------------------------------------------------------------------
    def _chunks(self, audio: np.ndarray, chunking: Chunking) -> Iterator[Chunk]:
        """The upload's speech, packed into chunks of at most 30 s, each as soon as the VAD has settled it.
        Blocking per step (a generator: the first `next` levels the loudness too), each `next` running the
        VAD only as far as the next chunk."""
        heard = normalized(audio) if chunking.normalize else audio
        yield from plan(self.vad.regions_as_found(heard, chunking.params, CHUNK_SECONDS))

    async def _chunk_results(
        self, request_id: str, audio: np.ndarray, options: DecodingOptions, chunking: Chunking
    ) -> AsyncGenerator[tuple[Chunk, Transcription, float], None]:
        """Each chunk with its transcription and queue time, in order. Chunks are queued as the VAD finds them
        (in a thread, one chunk ahead), at most `max_batch` of a request at once: they fill a batch together,
        other requests' jobs take turns with them, and the VAD listens on while they are decoded."""
        chunks = self._chunks(audio, chunking)
        found: asyncio.Future[Chunk | None] | None = asyncio.ensure_future(asyncio.to_thread(next, chunks, None))
        queued: deque[tuple[Chunk, asyncio.Future[tuple[Transcription, float]]]] = deque()
        dispatched = 0
        try:
            while True:
                while found is not None and found.done() and len(queued) < self.settings.max_batch:
                    chunk = found.result()
                    found = None if chunk is None else asyncio.ensure_future(asyncio.to_thread(next, chunks, None))
                    if chunk is not None:
                        job = Job(f"{request_id}-{dispatched}", chunk.audio(audio), options)
                        queued.append((chunk, asyncio.ensure_future(self.result(self.submit(job)))))
                        dispatched += 1
                if not queued and found is None:
                    return
                waits: list[asyncio.Future[Any]] = [queued[0][1]] if queued else []
                if found is not None and len(queued) < self.settings.max_batch:
                    waits.append(found)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if queued and queued[0][1].done():
                    chunk, result = queued.popleft()
                    yield (chunk, *result.result())
        finally:  # the client went away, or a chunk failed: drop the rest (a VAD step under way ends by itself)
            for future in [f for _, f in queued] + ([found] if found is not None else []):
                future.cancel()
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: its error is the one already raised, or moot

    async def transcribe_stream(
        self, req: TranscriptionRequest, request_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Validate and queue the request now (errors raise here), then return its events:
        `transcript.text.delta` per segment as windows complete, then `transcript.text.done`."""
        started = time.perf_counter()
        options = self._options(req)
        chunking = self._chunking(req)
        audio = await self._audio(req)
        request_id = request_id or uuid.uuid4().hex
        if chunking is not None:
            return self._chunked_events(req, request_id, audio, options, chunking, started)
        pending = self.submit(Job(request_id, audio, options, stream=True))
        return self._events(req, pending, started)

    async def _chunked_events(
        self,
        req: TranscriptionRequest,
        request_id: str,
        audio: np.ndarray,
        options: DecodingOptions,
        chunking: Chunking,
        started: float,
    ) -> AsyncIterator[dict[str, Any]]:
        """`transcript.text.delta` per chunk, in order, then `transcript.text.done`."""
        parts: list[tuple[Chunk, Transcription, float]] = []
        sent = False
        try:
            async with aclosing(self._chunk_results(request_id, audio, options, chunking)) as results:
                async for part in results:
                    parts.append(part)
                    segments = part[1].segments
                    text = "".join(s.text for s in segments)  # as `merge` joins them
                    delta = text if sent else text.lstrip()
                    if delta.strip():
                        yield _delta(req, delta, segments)
                        sent = True
        except errors.ApiError as exc:
            yield {"type": "error", **exc.body()}
            return
        transcription = _merged(parts, audio, options)
        reply = self._reply(req, transcription, parts[0][2] if parts else 0.0, (time.perf_counter() - started) * 1000)
        yield _done(req, transcription, reply.metrics)

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
                    yield _delta(req, delta, segments)
            try:
                transcription, queue_ms = await outcome
            except errors.ApiError as exc:
                yield {"type": "error", **exc.body()}
                return
            text, confirmed = transcription.text, sent.strip()
            if text != confirmed and text.startswith(confirmed):
                yield _delta(req, text[len(confirmed) :], [])
            reply = self._reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)
            yield _done(req, transcription, reply.metrics)
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
            "decoding": m.decoding,
            "beam_size": m.beam_size,
        }
        self._observe(metrics)
        self.metrics.decoded_tokens.labels(m.decoding).inc(m.tokens)
        self.metrics.main_passes.labels(m.decoding).inc(m.main_passes)
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
        if req.logprobs:
            body["logprobs"] = [p.to_dict() for p in t.logprobs]
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
