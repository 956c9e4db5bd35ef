"""The utterance pipeline of a live session: the uncommitted audio, and committed turns transcribed in order.

A turn's final transcription may begin before the turn is committed (an `EarlyFinal`, at a pause of the VAD,
on exactly the audio a commit there would transcribe); `Finals` then awaits it instead of beginning anew.
Each completed item gets its text as one delta (deltas only carry text that will not change, so they add up
to the transcript) and then `...transcription.completed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE
from app.api.types import DecodingOptions, Transcription
from app.server.realtime import events
from app.server.serving.live import LiveService
from app.speakers.live import LiveSpeakers

FINAL_RETRY_S = 0.2


def retrieve(task: asyncio.Task[Any]) -> None:
    """Retrieve a dropped task's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


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


TranscriptionTask = asyncio.Task[tuple[Transcription, float]]


@dataclass
class EarlyFinal:
    """The open turn's final transcription, begun at a pause: the turn's audio up to `end`."""

    item_id: str
    end: int
    task: TranscriptionTask


@dataclass
class Utterance:
    """A committed turn: `audio` (float32 at 16 kHz) is what its transcription hears, `seconds` how long the
    committed audio is (its speech and the silence that ended it)."""

    item_id: str
    audio: np.ndarray
    seconds: float
    closed_at: float  # perf_counter when its last audio arrived (commit, VAD stop or cut)
    early: TranscriptionTask | None = None


class Finals:
    """Committed turns, transcribed one after another in the finished-utterance lane, each completed in order."""

    def __init__(
        self,
        service: LiveService,
        emit: Callable[[dict[str, Any]], None],
        options: Callable[[], DecodingOptions],
        logprobs: Callable[[], bool],
        timeout_s: float,
        diarize: Callable[[], bool] = lambda: False,
    ) -> None:
        self.service = service
        self._emit, self._options, self._logprobs, self._diarize = emit, options, logprobs, diarize
        self._timeout_s = timeout_s
        self.speakers = LiveSpeakers()  # the session's voices, when it asks who spoke
        self._queue: asyncio.Queue[Utterance] = asyncio.Queue()
        self.backlog_samples = 0  # committed audio not yet completed
        self._task = asyncio.create_task(self._run())

    def begin(self, audio: np.ndarray) -> TranscriptionTask:
        """Start a final transcription of `audio` now (an early final)."""
        return asyncio.create_task(
            self.service.transcribe_live(audio, self._options(), final=True, prints=self._diarize())
        )

    def put(self, utterance: Utterance) -> None:
        self.backlog_samples += utterance.audio.size
        self._queue.put_nowait(utterance)

    async def aclose(self) -> None:
        """Cancel what is pending."""
        while not self._queue.empty():
            if (early := self._queue.get_nowait().early) is not None:
                early.cancel()
                early.add_done_callback(retrieve)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    async def _run(self) -> None:
        while True:
            utterance = await self._queue.get()
            try:
                await self._finish(utterance)
            finally:
                self.backlog_samples -= utterance.audio.size

    async def _transcribe(self, u: Utterance) -> tuple[Transcription, float] | None:
        """The turn's transcription and its queueing time (ms); None (with a `failed` event) when it cannot run.
        A finished utterance is not dropped for a busy server: 429 and 503 are retried until the timeout."""
        deadline = time.perf_counter() + self._timeout_s
        while True:
            try:
                if u.early is not None:
                    early, u.early = u.early, None
                    return await early  # begun at the pause, on the same audio
                return await self.service.transcribe_live(u.audio, self._options(), final=True, prints=self._diarize())
            except errors.ApiError as exc:
                if exc.status in (429, 503) and time.perf_counter() < deadline:
                    await asyncio.sleep(FINAL_RETRY_S)
                    continue
                self._emit(events.failed(u.item_id, exc))
                return None

    async def _finish(self, u: Utterance) -> None:
        done = await self._transcribe(u)
        if done is None:
            return
        transcription, queue_ms = done
        logprobs = self._logprobs()
        if transcription.text:
            entries = [p.to_dict() for p in transcription.logprobs] if logprobs else None
            self._emit(events.delta(u.item_id, transcription.text, entries))
        metrics = self.service.utterance_metrics(transcription, queue_ms, time.perf_counter() - u.closed_at)
        speaker = self.speakers.label(transcription.voices) if self._diarize() else None
        self._emit(events.completed(u.item_id, transcription, u.seconds, metrics, logprobs, speaker))
