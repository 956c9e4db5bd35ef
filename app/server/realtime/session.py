"""One live transcription session: client events in, server events out.

Audio is appended as base64 pcm16 (24 or 16 kHz) or G.711 (8 kHz), decoded, resampled to 16 kHz and cut into
turns ("items") by turn detection (`turns.py`: server or semantic VAD), by the client's
`input_audio_buffer.commit`, or at `realtime_max_utterance_s`. A committed turn is transcribed in order
through the finished-utterance lane of the batcher (`utterances.py`); a turn ended by the VAD usually has its
transcription under way already, begun at the pause that became its end.

Sessions open as OpenAI's do: `session.created` in the GA shape, or `transcription_session.created` in the beta
shape for a beta client (the `OpenAI-Beta: realtime=v1` header, or a first `transcription_session.update`).

The transport (the WebSocket route) hands each client message to `handle` and sends what `emit` queues;
`doomed` is set when the client must be disconnected.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, LiveResampler, decode_raw
from app.api.types import DecodingOptions, InvalidRequestError, Transcription
from app.server.realtime import events
from app.server.realtime.config import SessionConfig, apply_update
from app.server.realtime.partials import Partials
from app.server.realtime.turns import Turn, TurnFollower
from app.server.realtime.utterances import AudioBuffer, EarlyFinal, Finals, Utterance, retrieve
from app.server.serving.live import LiveService
from app.settings import Settings

OUTBOUND_LIMIT = 512  # queued server events; a client that stops reading is disconnected
MIN_TURN_S = 0.5  # a pause earlier in a turn than this begins no final


class Closing(Exception):
    """The session must end: the client is told why, then disconnected with `code`."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class RealtimeSession:
    def __init__(self, service: LiveService, settings: Settings, *, beta: bool = False) -> None:
        self.service = service
        self.settings = settings
        self.id = events.new_id("sess")
        self.beta = beta  # the client speaks the beta protocol
        self._created = False
        self.config = SessionConfig(model=service.model_id)
        self.outbound: asyncio.Queue[dict[str, Any]] = asyncio.Queue(OUTBOUND_LIMIT)
        self.doomed: asyncio.Future[Closing] = asyncio.get_running_loop().create_future()
        self.buffer = AudioBuffer()
        self.turns = self._follower()
        self._resampler: LiveResampler | None = None
        self.item_id: str | None = None  # the open turn
        self.item_start = 0
        self.previous_item_id: str | None = None
        self._early: EarlyFinal | None = None  # begun at the open pause
        self._unread: list[EarlyFinal] = []  # semantic VAD: begun at pauses the speech went on from, not read yet
        self.finals = Finals(
            service,
            self.emit,
            self._options,
            lambda: self.config.logprobs,
            settings.request_timeout_s,
            diarize=lambda: self.config.diarize,
        )
        interval = settings.realtime_partial_interval_s
        self.partials = Partials(service, self.emit, self._options, lambda: self.item_id, interval)

    def _follower(self) -> TurnFollower | None:
        detection = self.config.turn_detection
        return TurnFollower(self.service.vad, detection, self.buffer.end) if detection is not None else None

    # -- outbound ------------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        event = {"event_id": events.new_id("event"), **event}
        try:
            self.outbound.put_nowait(event)
        except asyncio.QueueFull:
            self.close(Closing(1008, "the client is not reading its events"))

    def error(self, message: str, code: str, param: str | None = None, client_event: str | None = None) -> None:
        self.service.live_error(code)
        self.emit(events.error(message, code, param, client_event))

    def close(self, closing: Closing) -> None:
        if not self.doomed.done():
            self.doomed.set_result(closing)

    def started(self) -> None:
        """The session's first event: created, in the shape the client speaks."""
        self._created = True
        if self.beta:
            self.emit({"type": "transcription_session.created", "session": self.config.beta(self.id)})
        else:
            self.emit({"type": "session.created", "session": self.config.ga(self.id)})

    async def aclose(self) -> None:
        """Free everything: pending transcriptions are cancelled."""
        self._drop_early_final()
        await self.partials.aclose()
        await self.finals.aclose()

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
        beta = event["type"] == "transcription_session.update"
        if beta and not self.beta:  # a beta client that did not say so: it waits for the beta event
            self.beta = True
            self.emit({"type": "transcription_session.created", "session": self.config.beta(self.id)})
        try:
            config = apply_update(self.config, event.get("session", {}))
            self.service.live_options(config.model, config.decoding_language, config.decoding_prompt)
        except InvalidRequestError as exc:
            self.error(str(exc), "invalid_value", exc.param, event_id)
            return
        except errors.ApiError as exc:
            self.error(exc.message, exc.code or "invalid_value", exc.param, event_id)
            return
        if (config.audio_format, config.rate) != (self.config.audio_format, self.config.rate):
            self._resampler = None
        changed = config.turn_detection != self.config.turn_detection
        self.config = config
        if changed:
            self.turns = self._follower()
        if beta:
            self.emit({"type": "transcription_session.updated", "session": config.beta(self.id)})
        else:
            self.emit({"type": "session.updated", "session": config.ga(self.id)})

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
        if samples.size:  # an empty chunk (or one the resampler holds back) opens no turn
            self._ingest(samples)

    def _commit(self, event: dict[str, Any], event_id: str | None) -> None:
        if self.buffer.end == (self.item_start if self.item_id is not None else self.buffer.start):
            self.error("The input audio buffer is empty.", "input_audio_buffer_commit_empty", None, event_id)
            return
        if self.item_id is None:
            self._open(self.buffer.start)
        self._close_item(self.buffer.end, self.buffer.end)

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

    # -- turns ---------------------------------------------------------------------------------------
    def _ingest(self, samples: np.ndarray) -> None:
        self.buffer.append(samples)
        if self.turns is not None:
            for turn in self.turns.feed(samples):
                self._on_turn(turn)
            if self.item_id is None:  # keep only the pre-roll that a coming turn may need
                self.buffer.drop_before(self.buffer.end - self.turns.padding)
        elif self.item_id is None:
            self._open(self.buffer.start)
        if self.item_id is not None:
            self._cut_long_utterance()
        if self.item_id is not None and self.config.partials and self._early is None:
            self.partials.maybe(self.item_id, self.item_start, self.buffer)
        backlog = (self.finals.backlog_samples + self.buffer.end - self.buffer.start) / SAMPLE_RATE
        if backlog > self.settings.realtime_max_backlog_s:
            self.error(
                f"More than {self.settings.realtime_max_backlog_s:g} s of audio is waiting; send audio in real time.",
                "input_audio_buffer_overflow",
            )
            raise Closing(1008, "audio backlog too large")

    def _on_turn(self, turn: Turn) -> None:
        """Open a turn when speech starts (with its pre-roll), begin its final at a pause, end it at a stop."""
        assert self.turns is not None
        if turn.kind == "start" and self.item_id is None:
            self._open(max(self.buffer.start, turn.sample - self.turns.padding))
            ms = turn.sample * 1000 // SAMPLE_RATE
            self.emit(events.speech_started(ms, self.item_id or ""))
        elif turn.kind == "stop" and self.item_id is not None:
            self.emit(events.speech_stopped(turn.end * 1000 // SAMPLE_RATE, self.item_id))
            self._close_item(turn.end, turn.sample + self.turns.tail)
        elif turn.kind == "split" and self.item_id is not None:
            # The words said the turn was over at a pause that the next speech has already ended: the turn ends
            # there, and the speech since then is the next one.
            start = max(turn.sample + self.turns.tail, turn.end - self.turns.padding)
            self.emit(events.speech_stopped(start * 1000 // SAMPLE_RATE, self.item_id))
            self._close_item(start, turn.sample + self.turns.tail)
            self._open(start)
            self.emit(events.speech_started(turn.end * 1000 // SAMPLE_RATE, self.item_id or ""))
            if (paused_at := self.turns.paused_at) is not None:  # the next turn is in a pause already
                self._begin_early_final(paused_at)
        elif turn.kind == "pause" and self.item_id is not None:
            self._begin_early_final(turn.sample)
        elif (
            turn.kind == "resume"
            and self._early is not None
            and self.turns.may_split(self._early.end - self.turns.tail)
        ):
            self._unread.append(self._early)  # its words may still say the turn had ended at that pause
            self._early = None
        elif turn.kind == "resume":
            self._drop_early_final()

    def _cut_long_utterance(self) -> None:
        """Whisper hears 30 s at a time: a longer turn is closed there and the rest opens a new one."""
        limit = int(self.settings.realtime_max_utterance_s * SAMPLE_RATE)
        while self.item_id is not None and self.buffer.end - self.item_start >= limit:
            cut = self.item_start + limit
            still_speaking = self.turns is not None and self.turns.speaking
            self._close_item(cut, cut)
            if still_speaking or (self.turns is None and self.buffer.end > cut):
                self._open(cut)

    def _open(self, start: int) -> None:
        self.item_id = events.new_id("item")
        self.item_start = start

    def _drop_open_item(self) -> None:
        self.item_id = None
        self.partials.cancel()
        self._drop_early_final()

    def _begin_early_final(self, speech_end: int) -> None:
        """The speaker paused: transcribe the turn as a stop here would commit it (its speech up to `speech_end`
        and the tail of silence after it), so that the stop finds its final done or under way. Under semantic
        VAD, the text then says whether the turn is over."""
        assert self.item_id is not None and self.turns is not None
        self._drop_early_final()
        end = speech_end + self.turns.tail
        if end - self.item_start < MIN_TURN_S * SAMPLE_RATE:
            return
        self.partials.cancel()  # the final supersedes it
        task = self.finals.begin(self.buffer.slice(self.item_start, end))
        self._early = EarlyFinal(self.item_id, end, task)
        task.add_done_callback(lambda done: self._read_early_final(speech_end, done))

    def _read_early_final(self, speech_end: int, task: asyncio.Task[tuple[Transcription, float]]) -> None:
        """Semantic VAD: the paused turn's words are in; end the turn if they say it is over (at the pause, even
        if the speech has gone on since)."""
        mine = [e for e in (self._early, *self._unread) if e is not None and e.task is task]
        if not mine or task.cancelled() or task.exception() is not None:
            return
        if self.turns is not None and (turn := self.turns.read(speech_end, task.result()[0].text)) is not None:
            self._on_turn(turn)
        if mine[0] in self._unread:  # read, and the turn went on: moot
            self._unread.remove(mine[0])
            self.service.early_final(used=False)

    def _drop_early_final(self) -> None:
        """The speech went on (or the turn was closed elsewhere or dropped): the early finals are moot."""
        for early in (self._early, *self._unread):
            if early is not None:
                early.task.cancel()
                early.task.add_done_callback(retrieve)
                self.service.early_final(used=False)
        self._early, self._unread = None, []

    def _close_item(self, end: int, heard_until: int) -> None:
        """Commit the open turn: its audio up to `end`; its transcription hears it up to `heard_until`."""
        assert self.item_id is not None
        item_id = self.item_id
        heard_until = min(end, heard_until)
        audio = self.buffer.slice(self.item_start, heard_until)
        early = None
        for candidate in (self._early, *self._unread):
            if candidate is not None and (candidate.item_id, candidate.end) == (item_id, heard_until):
                early = candidate.task  # the same audio: its final is the early one
                self._unread = [e for e in self._unread if e is not candidate]
                self._early = None if candidate is self._early else self._early
                self.service.early_final(used=True)
                break
        seconds = (end - self.item_start) / SAMPLE_RATE
        self._drop_open_item()
        self.buffer.drop_before(end)
        self.emit(events.committed(item_id, self.previous_item_id))
        self.previous_item_id = item_id
        self.finals.put(Utterance(item_id, audio, seconds, time.perf_counter(), early))

    def _options(self) -> DecodingOptions:
        c = self.config
        return self.service.live_options(c.model, c.decoding_language, c.decoding_prompt)
