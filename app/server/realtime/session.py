"""One live transcription session: client events in, server events out.

Audio is appended as base64 pcm16 (24 or 16 kHz) or G.711 (8 kHz), decoded, resampled to 16 kHz and cut
into utterances ("items") by the server VAD, by the client's `input_audio_buffer.commit`, or at
`realtime_max_utterance_s`. While an utterance is open it is re-transcribed every `realtime_partial_interval_s` of new
audio; words that two consecutive partials agree on are sent as `...transcription.delta`
events (so deltas only grow). A closed utterance is transcribed once more, in order, through
the finished-utterance lane of the batcher, and completed with its metrics.

The transport (the WebSocket route) hands each client message to `handle` and sends what
`emit` queues; `doomed` is set when the client must be disconnected.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, LiveResampler, decode_raw
from app.api.types import DecodingOptions, InvalidRequestError, Transcription
from app.server.realtime.config import SessionConfig, apply_update
from app.server.serving.service import TranscriptionService
from app.server.vad import SpeechStream
from app.settings import Settings

log = logging.getLogger("specwhisper.realtime")
MIN_PARTIAL_S = 0.5
OUTBOUND_LIMIT = 512  # queued server events; a client that stops reading is disconnected
FINAL_RETRY_S = 0.2
MAX_ECHO = 512  # longest error message / event id sent back to a client


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Retrieve a dropped task's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def _norm(word: str) -> str:
    """A word as heard: case and surrounding punctuation vary between partials of the same speech."""
    return word.strip(".,;:!?\"'()[]«»¿¡…-").lower()


def _same_words(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) and all(_norm(x) == _norm(y) for x, y in zip(a, b, strict=True))


def _remainder(confirmed: str, final: str) -> str:
    """What the final text adds after the words already sent as deltas ("" when it took another path).

    Deltas spell the final text's words; its punctuation and case may differ where a partial had
    them differently (the `completed` transcript is the authoritative text)."""
    if final.startswith(confirmed):
        return final[len(confirmed) :]
    sent, words = confirmed.split(), final.split()
    if not _same_words(words[: len(sent)], sent) or len(words) == len(sent):
        return ""
    return " " + " ".join(words[len(sent) :])


def _word_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def _logprobs_between(t: Transcription, start: int, end: int) -> list[dict[str, Any]]:
    """OpenAI's `logprobs` entries of the tokens that spell characters [start, end) of `t.text` (a token on
    either edge counts; a token's leading space belongs to the word after it)."""
    raw = b"".join(bytes(p.bytes) for p in t.logprobs)
    joined = raw.decode("utf-8", errors="replace")  # `t.text` is this text, stripped
    lead = len(joined) - len(joined.lstrip())
    first, last = len(joined[: lead + start].encode()), len(joined[: lead + end].encode())
    out, at = [], 0
    for p in t.logprobs:
        if at < last and at + len(p.bytes) > first:
            out.append(p.to_dict())
        at += len(p.bytes)
    return out


@dataclass
class Utterance:
    item_id: str
    audio: np.ndarray  # (samples,) float32 at 16 kHz
    closed_at: float  # perf_counter when its last audio arrived (commit, VAD stop or cut)
    confirmed: str  # text already sent as deltas
    early: asyncio.Task[tuple[Transcription, float]] | None = None  # its final, begun when the silence began


@dataclass
class EarlyFinal:
    """The open utterance's final transcription, begun at a pause of the VAD: the utterance up to `end`."""

    item_id: str
    end: int
    task: asyncio.Task[tuple[Transcription, float]]


class Closing(Exception):
    """The session must end: the client is told why, then disconnected with `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class AudioBuffer:
    """The uncommitted audio: 16-kHz samples with absolute positions since the session began."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.start = 0  # absolute position of the first buffered sample
        self.end = 0  # absolute position after the last received sample

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / SAMPLE_RATE

    def append(self, audio: np.ndarray) -> None:
        self.chunks.append(audio)
        self.end += audio.size

    def slice(self, start: int, end: int) -> np.ndarray:
        data = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)
        self.chunks = [data] if data.size else []
        return data[max(0, start - self.start) : max(0, end - self.start)]

    def drop_before(self, position: int) -> None:
        position = min(max(position, self.start), self.end)
        data = self.slice(position, self.end)
        self.chunks = [data] if data.size else []
        self.start = position

    def clear(self) -> None:
        self.chunks, self.start = [], self.end


class RealtimeSession:
    def __init__(self, service: TranscriptionService, settings: Settings) -> None:
        self.service = service
        self.settings = settings
        self.id = _id("sess")
        self.config = SessionConfig(model=service.model_id)
        self.outbound: asyncio.Queue[dict[str, Any]] = asyncio.Queue(OUTBOUND_LIMIT)
        self.doomed: asyncio.Future[Closing] = asyncio.get_running_loop().create_future()
        self.buffer = AudioBuffer()
        self.vad = service.vad.stream(self.config.vad) if self.config.vad else None
        self._resampler: LiveResampler | None = None
        self.item_id: str | None = None  # the open utterance
        self.item_start = 0
        self.previous_item_id: str | None = None
        self.confirmed = ""  # words of the open utterance already sent as deltas
        self._hypothesis: list[str] = []
        self._partial_at = 0  # buffer position of the last partial
        self._partial: asyncio.Task[None] | None = None
        self._early: EarlyFinal | None = None
        self._finals: asyncio.Queue[Utterance] = asyncio.Queue()
        self._backlog_samples = 0  # closed utterances not yet completed
        self._final_task = asyncio.create_task(self._run_finals(), name=f"{self.id}-finals")

    # -- outbound ------------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        event = {"event_id": _id("event"), **event}
        try:
            self.outbound.put_nowait(event)
        except asyncio.QueueFull:
            self.close(Closing(1008, "the client is not reading its events"))

    def error(self, message: str, code: str, param: str | None = None, client_event: str | None = None) -> None:
        self.service.live_error(code)
        # Messages may quote client values (an event type, a model name): clip them, or one client could make
        # the server hold its outbound queue full of megabyte-sized echoes.
        message = message if len(message) <= MAX_ECHO else message[:MAX_ECHO] + "..."
        client_event = client_event[:MAX_ECHO] if client_event else client_event
        body = {"type": "invalid_request_error", "code": code, "message": message, "param": param}
        self.emit({"type": "error", "error": {**body, "event_id": client_event}})

    def close(self, closing: Closing) -> None:
        if not self.doomed.done():
            self.doomed.set_result(closing)

    def started(self) -> None:
        self.emit({"type": "transcription_session.created", "session": self.config.beta(self.id)})

    async def aclose(self) -> None:
        """Free everything: pending partial and final transcriptions are cancelled."""
        self._drop_early_final()
        while not self._finals.empty():
            if (early := self._finals.get_nowait().early) is not None:
                early.cancel()
                early.add_done_callback(_retrieve)
        for task in (self._partial, self._final_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # -- inbound -------------------------------------------------------------------------------------
    def handle(self, message: str | bytes) -> None:
        """One client message. Bad events get `error` events; abuse raises Closing."""
        if isinstance(message, bytes):
            self.error("Binary frames are not supported; send JSON text events.", "invalid_event")
            return
        if len(message) > self.settings.realtime_max_event_bytes:
            limit = self.settings.realtime_max_event_bytes
            self.error(f"Event of {len(message)} bytes exceeds the limit of {limit} bytes.", "event_too_large")
            raise Closing(1009, "event too large")
        try:
            event = json.loads(message)
        except ValueError:
            self.error("The event is not valid JSON.", "invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self.error("An event must be a JSON object with a string `type`.", "invalid_event", "type")
            return
        kind, raw_id = event["type"], event.get("event_id")
        event_id = raw_id if isinstance(raw_id, str) else None
        handler = self._handlers.get(kind)
        if handler is None:
            self.error(f"Unknown or unsupported event type {kind!r}.", "invalid_event", "type", event_id)
            return
        handler(self, event, event_id)

    def _update(self, event: dict[str, Any], event_id: str | None) -> None:
        try:
            config = apply_update(self.config, event.get("session", {}))
            self.service.live_options(config.model, config.language, config.prompt)
        except InvalidRequestError as exc:
            self.error(str(exc), "invalid_value", exc.param, event_id)
            return
        except errors.ApiError as exc:
            self.error(exc.message, exc.code or "invalid_value", exc.param, event_id)
            return
        if (config.audio_format, config.rate) != (self.config.audio_format, self.config.rate):
            self._resampler = None
        if config.vad != self.config.vad:
            self.vad = self.service.vad.stream(config.vad) if config.vad else None
        self.config = config
        if event["type"] == "session.update":
            self.emit({"type": "session.updated", "session": config.ga(self.id)})
        else:
            self.emit({"type": "transcription_session.updated", "session": config.beta(self.id)})

    def _append(self, event: dict[str, Any], event_id: str | None) -> None:
        fmt = self.config.audio_format
        audio = event.get("audio")
        if not isinstance(audio, str):
            self.error(f"`audio` must be a base64 string of {fmt} audio.", "invalid_value", "audio", event_id)
            return
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            self.error("`audio` is not valid base64.", "invalid_base64", "audio", event_id)
            return
        try:
            samples = decode_raw(data, fmt)
        except AudioError as exc:
            self.error(f"{exc}.", "invalid_audio", "audio", event_id)
            return
        if self.config.rate != SAMPLE_RATE:
            if self._resampler is None:
                self._resampler = LiveResampler(self.config.rate)
            samples = self._resampler(samples)
        if samples.size:  # an empty chunk (or one the resampler holds back) opens no utterance
            self._ingest(samples)

    def _commit(self, event: dict[str, Any], event_id: str | None) -> None:
        if self.buffer.end == (self.item_start if self.item_id is not None else self.buffer.start):
            self.error("The input audio buffer is empty.", "input_audio_buffer_commit_empty", None, event_id)
            return
        if self.item_id is None:
            self._open(self.buffer.start)
        self._close_item(self.buffer.end)

    def _clear(self, event: dict[str, Any], event_id: str | None) -> None:
        self._drop_open_item()
        self.buffer.clear()
        self.emit({"type": "input_audio_buffer.cleared"})

    _handlers: ClassVar[dict[str, Callable[[RealtimeSession, dict[str, Any], str | None], None]]] = {
        "transcription_session.update": _update,
        "session.update": _update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
    }

    # -- utterances ----------------------------------------------------------------------------------
    def _ingest(self, samples: np.ndarray) -> None:
        self.buffer.append(samples)
        if self.vad is not None:
            self._follow_vad(self.vad, samples)
        elif self.item_id is None:
            self._open(self.buffer.start)
        if self.item_id is not None:
            self._cut_long_utterance()
            self._maybe_partial()
        backlog = (self._backlog_samples + self.buffer.end - self.buffer.start) / SAMPLE_RATE
        if backlog > self.settings.realtime_max_backlog_s:
            self.error(
                f"More than {self.settings.realtime_max_backlog_s:g} s of audio is waiting; send audio in real time.",
                "input_audio_buffer_overflow",
            )
            raise Closing(1008, "audio backlog too large")

    def _follow_vad(self, vad: SpeechStream, samples: np.ndarray) -> None:
        """Open an utterance when speech starts (with its pre-roll), close it when speech stops."""
        padding = vad.params.prefix_padding_ms * SAMPLE_RATE // 1000
        for change in vad.feed(samples):
            ms = change.sample * 1000 // SAMPLE_RATE
            if change.kind == "start" and self.item_id is None:
                self._open(max(self.buffer.start, change.sample - padding))
                self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms, "item_id": self.item_id})
            elif change.kind == "stop" and self.item_id is not None:
                self.emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms, "item_id": self.item_id})
                self._close_item(change.sample)
            elif change.kind == "pause" and self.item_id is not None:
                self._begin_early_final(change.sample)
            elif change.kind == "resume":
                self._drop_early_final()
        if self.item_id is None:  # keep only the pre-roll that a coming utterance may need
            self.buffer.drop_before(self.buffer.end - padding)

    def _cut_long_utterance(self) -> None:
        """Whisper hears 30 s at a time: a longer utterance is closed there and the rest opens a new one."""
        limit = int(self.settings.realtime_max_utterance_s * SAMPLE_RATE)
        while self.item_id is not None and self.buffer.end - self.item_start >= limit:
            cut = self.item_start + limit
            still_speaking = self.vad is not None and self.vad.speaking
            self._close_item(cut)
            if still_speaking or (self.vad is None and self.buffer.end > cut):
                self._open(cut)

    def _open(self, start: int) -> None:
        self.item_id = _id("item")
        self.item_start = start
        self.confirmed = ""
        self._hypothesis = []
        self._partial_at = start

    def _drop_open_item(self) -> None:
        self.item_id = None
        if self._partial is not None:
            self._partial.cancel()
            self._partial = None
        self._drop_early_final()

    def _begin_early_final(self, end: int) -> None:
        """The speaker paused: transcribe the utterance up to `end` now, as its final would be if the silence
        lasts (`silence_duration_ms`); the stop then finds it done or under way, not yet to begin."""
        assert self.item_id is not None
        self._drop_early_final()
        if end - self.item_start < MIN_PARTIAL_S * SAMPLE_RATE:
            return
        if self._partial is not None:  # the final supersedes it
            self._partial.cancel()
            self._partial = None
        audio = self.buffer.slice(self.item_start, end)
        task = asyncio.create_task(self.service.transcribe_live(audio, self._options(), final=True))
        self._early = EarlyFinal(self.item_id, end, task)

    def _drop_early_final(self) -> None:
        """The speech went on (or the utterance was closed elsewhere or dropped): the early final is moot."""
        if self._early is not None:
            self._early.task.cancel()
            self._early.task.add_done_callback(_retrieve)
            self._early = None
            self.service.early_final(used=False)

    def _close_item(self, end: int) -> None:
        assert self.item_id is not None
        item_id, audio, confirmed = self.item_id, self.buffer.slice(self.item_start, end), self.confirmed
        early = None
        if self._early is not None and (self._early.item_id, self._early.end) == (item_id, end):
            early, self._early = self._early.task, None  # the same audio: its final is the early one
            self.service.early_final(used=True)
        self._drop_open_item()
        self.buffer.drop_before(end)
        self.emit(
            {"type": "input_audio_buffer.committed", "previous_item_id": self.previous_item_id, "item_id": item_id}
        )
        self.previous_item_id = item_id
        self._backlog_samples += audio.size
        self._finals.put_nowait(Utterance(item_id, audio, time.perf_counter(), confirmed, early))

    # -- transcription -------------------------------------------------------------------------------
    def _options(self) -> DecodingOptions:
        c = self.config
        return self.service.live_options(c.model, c.language, c.prompt)

    def _maybe_partial(self) -> None:
        interval = int(self.settings.realtime_partial_interval_s * SAMPLE_RATE)
        if self._partial is not None or self._early is not None or self.buffer.end - self._partial_at < interval:
            return
        if self.service.work_queued:  # finals and uploads go first; this utterance's partial can wait
            return
        if self.buffer.end - self.item_start < MIN_PARTIAL_S * SAMPLE_RATE:
            return
        if self.item_id is None:
            return
        self._partial_at = self.buffer.end
        audio = self.buffer.slice(self.item_start, self.buffer.end)
        self._partial = asyncio.create_task(self._run_partial(self.item_id, audio), name=f"{self.id}-partial")

    async def _run_partial(self, item_id: str, audio: np.ndarray) -> None:
        try:
            transcription, _ = await self.service.transcribe_live(audio, self._options(), final=False)
        except errors.ApiError as exc:
            log.info("partial skipped: %s", exc.message)
            return  # a partial is best effort: a busy server skips it
        except Exception:
            log.exception("partial transcription failed")
            return
        finally:
            if self._partial is asyncio.current_task():
                self._partial = None
        if item_id != self.item_id:
            return
        words = transcription.text.split()
        agreed = 0  # LocalAgreement: words two consecutive partials share are stable enough to send
        for a, b in zip(self._hypothesis, words, strict=False):
            if _norm(a) != _norm(b):
                break
            agreed += 1
        self._hypothesis = words
        sent = len(self.confirmed.split())
        if agreed > sent and _same_words(words[:sent], self.confirmed.split()):
            delta = " ".join(words[sent:agreed])
            delta = f" {delta}" if self.confirmed else delta
            self.confirmed += delta
            spans = _word_spans(transcription.text)
            entries = _logprobs_between(transcription, spans[sent][0], spans[agreed - 1][1])
            self.emit(self._delta(item_id, delta, entries))
        self._maybe_partial()

    def _delta(self, item_id: str, delta: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        """A delta event; with the session's `include` of logprobs, those of the tokens that spell it."""
        event: dict[str, Any] = {
            "type": "conversation.item.input_audio_transcription.delta",
            "item_id": item_id,
            "content_index": 0,
            "delta": delta,
        }
        if self.config.logprobs:
            event["logprobs"] = logprobs
        return event

    async def _run_finals(self) -> None:
        while True:
            utterance = await self._finals.get()
            try:
                await self._finish(utterance)
            finally:
                self._backlog_samples -= utterance.audio.size

    async def _finish(self, u: Utterance) -> None:
        deadline = time.perf_counter() + self.settings.request_timeout_s
        while True:
            try:
                if u.early is not None:
                    early, u.early = u.early, None
                    transcription, queue_ms = await early  # begun at the pause, on the same audio
                else:
                    transcription, queue_ms = await self.service.transcribe_live(u.audio, self._options(), final=True)
                break
            except errors.ApiError as exc:
                if exc.status in (429, 503) and time.perf_counter() < deadline:
                    await asyncio.sleep(FINAL_RETRY_S)  # a finished utterance is not dropped for a busy server
                    continue
                self.emit(
                    {
                        "type": "conversation.item.input_audio_transcription.failed",
                        "item_id": u.item_id,
                        "content_index": 0,
                        "error": {"type": exc.type, "code": exc.code, "message": exc.message, "param": None},
                    }
                )
                return
        text = transcription.text
        if rest := _remainder(u.confirmed, text):
            start = len(u.confirmed) if text.startswith(u.confirmed) else _word_spans(text)[len(u.confirmed.split())][0]
            self.emit(self._delta(u.item_id, rest, _logprobs_between(transcription, start, len(text))))
        metrics = self.service.utterance_metrics(transcription, queue_ms, time.perf_counter() - u.closed_at)
        completed: dict[str, Any] = {
            "type": "conversation.item.input_audio_transcription.completed",
            "item_id": u.item_id,
            "content_index": 0,
            "transcript": text,
            "usage": {"type": "duration", "seconds": round(u.audio.size / SAMPLE_RATE, 3)},
        }
        if self.config.logprobs:
            completed["logprobs"] = [p.to_dict() for p in transcription.logprobs]
        self.emit({**completed, "metrics": metrics})
