"""What the server reports about itself: readiness, the Prometheus exposition and the web page's live counters."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from app.server.memory import ProcessMemory
from app.server.metrics import Samples, ServerMetrics, samples_by_name
from app.server.serving.service import TranscriptionService
from app.server.worker.client import EngineClient, EngineHealth


class ServerStatus:
    """Reads the engine, the queue and the metrics; changes nothing but the gauges it reports."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, service: TranscriptionService) -> None:
        self.engine = engine
        self.metrics = metrics
        self.service = service

    def readiness(self) -> tuple[dict[str, Any], bool]:
        """The body of `/health/ready` and whether the server is ready to serve (the worker, and the VAD)."""
        health = self.engine.health()
        ready = health.ready
        is_ready = health.is_ready and self.service.vad.loaded
        body: dict[str, Any] = {
            "ready": is_ready,
            "model": ready.model if ready else None,
            "assistant": ready.assistant if ready else None,
            "engine": ready.engine if ready else None,
            "queue_depth": self.engine.depth,
            "worker_restarts": health.restarts,
            "worker_pid": health.pid,
        }
        body["memory"] = self._memory(health)
        if health.replicas is not None:
            body["replicas"] = health.replicas
        if health.failure is not None:
            body["error"] = health.failure
        if not self.service.vad.loaded:
            body["vad"] = "loading"
        return body, is_ready

    @staticmethod
    def _memory(health: EngineHealth) -> dict[str, Any]:
        """The processes' resident sets in MB (the worker's where it runs on this machine), and its budget."""
        web = ProcessMemory.of()
        worker = ProcessMemory.of(health.pid) if health.pid is not None else None
        out: dict[str, Any] = {
            "web_mb": round(web.rss_mb, 1) if web is not None else None,
            "worker_mb": round(worker.rss_mb, 1) if worker is not None else None,
        }
        if health.memory is not None:
            plan = health.memory
            out |= {
                "worker_budget_mb": plan.budget_mb,
                "worker_idle_mb": round(plan.idle_mb, 1),
                "clip_mb": round(plan.clip_mb, 1),
                "batch_limit": plan.batch,
            }
        return out

    def exposition(self) -> bytes:
        """The Prometheus text exposition, with the queue and worker gauges read now."""
        m, health = self.metrics, self.engine.health()
        worker = ProcessMemory.of(health.pid) if health.pid is not None else None
        if worker is not None:
            m.worker_memory.set(worker.rss)
        m.queue_depth.set(self.engine.depth)
        m.upload_steps_waiting.set(self.service.share.waiting)
        m.worker_up.set(1 if health.is_ready else 0)
        m.worker_restarts.set(health.restarts)
        return generate_latest(m.registry)

    def live_counters(self) -> dict[str, Any]:
        """Counters and gauges for the web page's live panel; the page turns successive snapshots into rates."""
        s = samples_by_name(self.metrics.registry.collect())
        buckets = {labels["le"]: value for labels, value in s.get("specwhisper_batch_size_bucket", [])}
        sizes, below = {}, 0.0
        for size in ("1.0", "2.0", "3.0", "4.0"):
            sizes[str(int(float(size)))] = buckets.get(size, 0.0) - below
            below = buckets.get(size, below)
        health = self.engine.health()
        ready = health.ready
        return {
            "ready": health.is_ready,
            "model": ready.model if ready else None,
            "assistant": ready.assistant if ready else None,
            "queue_depth": self.engine.depth,
            "inflight": self.engine.inflight,
            "batches": sizes,
            "requests": _total(s, "specwhisper_requests_total"),
            "audio_seconds": _total(s, "specwhisper_audio_seconds_total"),
            "tokens": _total(s, "specwhisper_tokens_total"),
            "drafted": _total(s, "specwhisper_draft_proposed_total"),
            "accepted": _total(s, "specwhisper_draft_accepted_total"),
            "realtime_sessions": self.service.live.sessions,
            "audio_in_flight_s": round(self.service.budget.held, 1),
            "worker_restarts": health.restarts,
        }


def _total(samples: Samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))
