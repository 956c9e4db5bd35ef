"""The browser page at `/` (static files, no build step) and the `/stats` snapshot its live panel polls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from prometheus_client import CollectorRegistry

STATIC = Path(__file__).parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def _samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in registry.collect():
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def snapshot(request: Request) -> dict[str, Any]:
    """Counters and gauges for the live panel; the page turns successive snapshots into rates."""
    state = request.app.state
    s = _samples(state.metrics.registry)
    buckets = {labels["le"]: value for labels, value in s.get("specwhisper_batch_size_bucket", [])}
    sizes, below = {}, 0.0
    for size in ("1.0", "2.0", "3.0", "4.0"):
        sizes[str(int(float(size)))] = buckets.get(size, 0.0) - below
        below = buckets.get(size, below)
    worker = state.worker
    return {
        "ready": worker.is_ready,
        "model": worker.ready.model if worker.ready else None,
        "assistant": worker.ready.assistant if worker.ready else None,
        "queue_depth": state.batcher.depth,
        "inflight": state.batcher.inflight,
        "batches": sizes,
        "requests": _total(s, "specwhisper_requests_total"),
        "audio_seconds": _total(s, "specwhisper_audio_seconds_total"),
        "tokens": _total(s, "specwhisper_tokens_total"),
        "drafted": _total(s, "specwhisper_draft_proposed_total"),
        "accepted": _total(s, "specwhisper_draft_accepted_total"),
        "realtime_sessions": state.realtime_sessions,
        "worker_restarts": worker.restarts,
    }


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    return JSONResponse(snapshot(request), headers={"Cache-Control": "no-store"})
