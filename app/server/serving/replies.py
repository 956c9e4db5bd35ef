"""What a request gets back: the body in its `response_format`, the SSE events, and the `metrics` object every answer
carries (also recorded in Prometheus)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.api.formats import to_srt, to_verbose_json, to_vtt
from app.api.types import Segment, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.requests import TranscriptionRequest


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


def done_event(req: TranscriptionRequest, t: Transcription, metrics: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "transcript.text.done", "text": t.text}
    if req.logprobs:
        event["logprobs"] = [p.to_dict() for p in t.logprobs]
    return {**event, "metrics": metrics}


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

    def reply(self, req: TranscriptionRequest, t: Transcription, queue_ms: float, total_ms: float) -> Reply:
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
