"""Hypotheses of the open turn while it is still spoken: opt-in (`include` PARTIALS), never deltas.

Every `realtime_partial_interval_s` of new audio the turn so far is transcribed again, in the partials' lane
(after finals and uploads, and skipped while other work waits), and sent as
`conversation.item.input_audio_transcription.partial` with the whole hypothesis as `transcript`: each
replaces the one before, and the item's `completed` replaces them all. Deltas stay text that will not
change, so OpenAI's clients, which add deltas up, never see a hypothesis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from app.api import errors
from app.api.audio import SAMPLE_RATE
from app.api.types import DecodingOptions
from app.server.realtime.utterances import AudioBuffer
from app.server.serving.live import LiveService

log = logging.getLogger("specwhisper.realtime")
MIN_PARTIAL_S = 0.5


class Partials:
    def __init__(
        self,
        service: LiveService,
        emit: Callable[[dict[str, Any]], None],
        options: Callable[[], DecodingOptions],
        current_item: Callable[[], str | None],
        interval_s: float,
    ) -> None:
        self.service = service
        self._emit, self._options, self._current_item = emit, options, current_item
        self._interval = int(interval_s * SAMPLE_RATE)
        self._task: asyncio.Task[None] | None = None
        self._at = 0  # buffer position of the last partial

    def maybe(self, item_id: str, start: int, buffer: AudioBuffer) -> None:
        """Transcribe turn `item_id` (its audio from `start`) again if enough new audio came and nothing waits."""
        if self._task is not None or buffer.end - max(self._at, start) < self._interval:
            return
        if self.service.work_queued or buffer.end - start < MIN_PARTIAL_S * SAMPLE_RATE:
            return  # finals and uploads go first; a partial can wait
        self._at = buffer.end
        self._task = asyncio.create_task(self._run(item_id, buffer.slice(start, buffer.end)))

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, item_id: str, audio: Any) -> None:
        try:
            transcription, _ = await self.service.transcribe_live(audio, self._options(), final=False)
        except errors.ApiError as exc:
            log.info("partial skipped: %s", exc.message)  # best effort: a busy server skips it
            return
        except Exception:
            log.exception("partial transcription failed")
            return
        finally:
            if self._task is asyncio.current_task():
                self._task = None
        if item_id == self._current_item():
            self._emit(
                {
                    "type": "conversation.item.input_audio_transcription.partial",
                    "item_id": item_id,
                    "content_index": 0,
                    "transcript": transcription.text,
                }
            )
