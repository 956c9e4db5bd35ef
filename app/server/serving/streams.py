"""Streamed answers (`stream=true`): an upload's SSE events as its windows or chunks complete.

`HeldEvents` wraps the events with what the upload holds (its place in the audio budget, its job), given back once
they end, fail or are closed. `job_events` streams a single-block upload's job, `chunk_events` a chunked upload's
chunks; both end in `transcript.text.done` (or an `error` event, after which the stream ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any

from app.api import errors
from app.api.types import Transcription
from app.server.serving.chunking import Part
from app.server.serving.jobs import Jobs
from app.server.serving.replies import Replies, delta_event, done_event, segment_events
from app.server.serving.requests import TranscriptionRequest
from app.server.worker.client import Pending, progress_until
from app.speakers.diarization import Diarization


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


async def job_events(
    req: TranscriptionRequest, pending: Pending, jobs: Jobs, replies: Replies, started: float
) -> AsyncIterator[dict[str, Any]]:
    """A single-block upload's events: a delta per segment as the job reports its windows, the rest of the text if
    the final answer differs from what was sent, then `transcript.text.done`."""
    progress = pending.progress
    assert progress is not None
    outcome = asyncio.ensure_future(jobs.result(pending))
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
        reply = replies.reply(req, transcription, queue_ms, (time.perf_counter() - started) * 1000)
        yield done_event(req, transcription, reply.metrics)
    finally:
        if not outcome.done():
            outcome.cancel()


async def chunk_events(
    req: TranscriptionRequest,
    results: Callable[[], AsyncGenerator[Part, None]],
    read_errors: Callable[[], AbstractAsyncContextManager[None]],
    finish: Callable[[Sequence[Part]], Awaitable[tuple[Transcription, Diarization | None]]],
    replies: Replies,
    started: float,
) -> AsyncIterator[dict[str, Any]]:
    """A chunked upload's events: `transcript.text.delta` per chunk, in order, then, when it asked who spoke,
    a `transcript.text.segment` per piece of the transcript (speakers are final once all of it was heard), then
    `transcript.text.done` with the whole transcription (`finish`). `read_errors` turns the audio's errors into the
    API's, as the whole answer would."""
    parts: list[Part] = []
    sent = False
    try:
        async with read_errors(), aclosing(results()) as chunks:
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
    try:
        transcription, diarization = await finish(parts)
    except errors.ApiError as exc:
        yield {"type": "error", **exc.body()}
        return
    if diarization is not None:
        for event in segment_events(diarization):
            yield event
    total_ms = (time.perf_counter() - started) * 1000
    reply = replies.reply(req, transcription, parts[0][2] if parts else 0.0, total_ms, diarization)
    yield done_event(req, transcription, reply.metrics)
