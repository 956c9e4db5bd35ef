"""What a request gets back: the body in its `response_format`, the SSE events, and the `metrics` object every answer
carries (also recorded in Prometheus)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.api.formats import to_srt, to_verbose_json, to_vtt
from app.api.types import Segment, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.requests import TranscriptionRequest
from app.speakers.diarization import Diarization


@dataclass(frozen=True)
class Reply:
    body: str
    media_type: str
    metrics: dict[str, Any]


def delta_event(req: TranscriptionRequest, delta: str, segments: Sequence[Segment]) -> dict[str, Any]:
    """A `transcript.text.delta` event: the new text, and its tokens' log-probabilities when asked for."""
    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
    if req.logprobs:
        event["logprobs"] = [p.to_dict() for s in segments for p in s.logprobs]
    return event


def segment_events(diarization: Diarization) -> list[dict[str, Any]]:
    """OpenAI's `transcript.text.segment` objects: each piece of the transcript with its speaker."""
    return [
        {
            "type": "transcript.text.segment",
            "id": f"seg_{i}",
            "start": round(p.start, 3),
            "end": round(p.end, 3),
            "text": p.text,
            "speaker": p.speaker,
        }
        for i, p in enumerate(diarization.segments)
    ]


def _with_speakers(body: dict[str, Any], t: Transcription, diarization: Diarization) -> dict[str, Any]:
    """verbose_json with `diarize=true`: each segment and word with the speaker heard most over it."""
    for segment, out in zip(t.segments, body["segments"], strict=True):
        out["speaker"] = diarization.speaker_at(segment.start, segment.end)
    for word in body.get("words", []):
        word["speaker"] = diarization.speaker_at(word["start"], word["end"])
    return body


def done_event(req: TranscriptionRequest, t: Transcription, metrics: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "transcript.text.done", "text": t.text}
    if req.logprobs:
        event["logprobs"] = [p.to_dict() for p in t.logprobs]
    return {**event, "metrics": metrics}


def usage(t: Transcription) -> dict[str, Any]:
    """OpenAI's `usage` of an answer billed by audio length."""
    return {"type": "duration", "seconds": math.ceil(t.duration)}


class Replies:
    """Shapes answers and records their measurements in `metrics`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

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

    def reply(
        self,
        req: TranscriptionRequest,
        t: Transcription,
        queue_ms: float,
        total_ms: float,
        diarization: Diarization | None = None,
    ) -> Reply:
        metrics = self.request_metrics(t, queue_ms, total_ms)
        fmt = req.response_format
        if fmt == "text":
            return Reply(t.text + "\n", "text/plain; charset=utf-8", metrics)
        if fmt == "srt":
            return Reply(to_srt(t), "text/plain; charset=utf-8", metrics)
        if fmt == "vtt":
            return Reply(to_vtt(t), "text/vtt; charset=utf-8", metrics)
        if fmt == "diarized_json":
            assert diarization is not None
            body = {"task": "transcribe", "duration": t.duration, "text": t.text}
            body |= {"segments": segment_events(diarization), "usage": usage(t)}
        elif fmt == "verbose_json":
            body = to_verbose_json(t, req.task, words="word" in req.timestamp_granularities)
            if diarization is not None:
                body = _with_speakers(body, t, diarization)
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
