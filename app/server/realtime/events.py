"""The server events of a transcription session, in OpenAI's Realtime shapes (GA and beta share them)."""

from __future__ import annotations

import uuid
from typing import Any

from app.api import errors
from app.api.types import Transcription

MAX_ECHO = 512  # longest error message / event id sent back to a client


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def error(message: str, code: str, param: str | None = None, client_event: str | None = None) -> dict[str, Any]:
    """An `error` event. Messages may quote client values (an event type, a model name): they are clipped, or one
    client could make the server hold its outbound queue full of megabyte-sized echoes."""
    message = message if len(message) <= MAX_ECHO else message[:MAX_ECHO] + "..."
    client_event = client_event[:MAX_ECHO] if client_event else client_event
    body = {"type": "invalid_request_error", "code": code, "message": message, "param": param}
    return {"type": "error", "error": {**body, "event_id": client_event}}


def speech_started(ms: int, item_id: str) -> dict[str, Any]:
    return {"type": "input_audio_buffer.speech_started", "audio_start_ms": ms, "item_id": item_id}


def speech_stopped(ms: int, item_id: str) -> dict[str, Any]:
    """`audio_end_ms` is where the turn's audio ends: its speech and the silence that ended it."""
    return {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms, "item_id": item_id}


def committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return {"type": "input_audio_buffer.committed", "previous_item_id": previous_item_id, "item_id": item_id}


def delta(item_id: str, text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A `...transcription.delta`: text that will not change (deltas of an item add up to its transcript)."""
    event: dict[str, Any] = {
        "type": "conversation.item.input_audio_transcription.delta",
        "item_id": item_id,
        "content_index": 0,
        "delta": text,
    }
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def completed(
    item_id: str,
    t: Transcription,
    seconds: float,
    metrics: dict[str, Any],
    logprobs: bool,
    speaker: str | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "conversation.item.input_audio_transcription.completed",
        "item_id": item_id,
        "content_index": 0,
        "transcript": t.text,
        "usage": {"type": "duration", "seconds": round(seconds, 3)},
    }
    if logprobs:
        event["logprobs"] = [p.to_dict() for p in t.logprobs]
    if speaker is not None:  # the session asked who spoke (`input_audio_transcription.diarize`)
        event["speaker"] = speaker
    return {**event, "metrics": metrics}


def failed(item_id: str, exc: errors.ApiError) -> dict[str, Any]:
    return {
        "type": "conversation.item.input_audio_transcription.failed",
        "item_id": item_id,
        "content_index": 0,
        "error": {"type": exc.type, "code": exc.code, "message": exc.message, "param": None},
    }
