"""Prometheus metrics of one server instance (own registry: no module-level state)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.metrics_core import Metric

Sample = tuple[dict[str, str], float]  # (labels, value)
Samples = dict[str, list[Sample]]

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specwhisper_requests", "HTTP requests", ["route", "status"], registry=r)
        self.queue_seconds = Histogram(
            "specwhisper_queue_seconds", "time waiting for a batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.encode_seconds = Histogram(
            "specwhisper_encode_seconds", "encoder time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.decode_seconds = Histogram(
            "specwhisper_decode_seconds", "decoding time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.total_seconds = Histogram(
            "specwhisper_request_seconds", "request time in the server", buckets=LATENCY_BUCKETS, registry=r
        )
        self.audio_seconds = Counter("specwhisper_audio_seconds", "audio transcribed", registry=r)
        self.tokens = Counter("specwhisper_tokens", "tokens generated", registry=r)
        self.draft_proposed = Counter("specwhisper_draft_proposed", "drafted tokens", registry=r)
        self.draft_accepted = Counter("specwhisper_draft_accepted", "drafted tokens accepted", registry=r)
        # by decoding ("greedy" or "beam"): their ratio is the tokens per main pass of each
        self.decoded_tokens = Counter(
            "specwhisper_decoded_tokens", "tokens of the answers, by decoding", ["decoding"], registry=r
        )
        self.main_passes = Counter(
            "specwhisper_main_passes", "main-model decoding passes, by decoding", ["decoding"], registry=r
        )
        self.batch_size = Histogram(
            "specwhisper_batch_size", "requests per batch", buckets=(1, 2, 3, 4, 8, 16), registry=r
        )
        self.batches = Counter(
            "specwhisper_batches", "batches decoded, by the mode the worker chose", ["mode"], registry=r
        )
        self.mode_cost = Gauge(
            "specwhisper_mode_cost_ms_per_pass",
            "the adaptive policy's estimate of a mode's decode time per plain pass (one token of a batch's"
            " longest row), by batch size; the worker runs the cheaper mode",
            ["mode", "batch_size"],
            registry=r,
        )
        self.queue_depth = Gauge("specwhisper_queue_depth", "requests waiting", registry=r)
        self.audio_in_flight = Gauge(
            "specwhisper_audio_in_flight_seconds", "audio held by admitted uploads (the audio budget's use)", registry=r
        )
        self.budget_waiting = Gauge(
            "specwhisper_audio_budget_waiting", "uploads waiting for room in the audio budget", registry=r
        )
        self.budget_refused = Counter(
            "specwhisper_audio_budget_refused", "uploads refused (429): the audio budget's line was full", registry=r
        )
        self.chunks_decoded_again = Counter(
            "specwhisper_chunks_decoded_again",
            "chunks Whisper wrote short, decoded again in halves (kept: whether the halves replaced the chunk)",
            ["kept"],
            registry=r,
        )
        self.upload_steps_waiting = Gauge(
            "specwhisper_upload_steps_waiting", "uploads waiting for an upload thread (decoding, VAD)", registry=r
        )
        self.worker_up = Gauge("specwhisper_worker_up", "1 when the worker is ready", registry=r)
        self.worker_restarts = Gauge("specwhisper_worker_restarts", "worker process restarts", registry=r)
        self.realtime_sessions = Gauge("specwhisper_realtime_sessions", "open WebSocket sessions", registry=r)
        self.utterance_latency = Histogram(
            "specwhisper_realtime_utterance_latency_seconds",
            "last audio of an utterance (commit, VAD stop or length cut) to its completed event",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.realtime_partials = Counter("specwhisper_realtime_partials", "partial re-transcriptions", registry=r)
        self.realtime_early_finals = Counter(
            "specwhisper_realtime_early_finals",
            "finals begun at a pause of the VAD: used (the silence lasted) or dropped (the speech went on)",
            ["outcome"],
            registry=r,
        )
        self.realtime_errors = Counter(
            "specwhisper_realtime_errors", "error events sent to realtime clients", ["code"], registry=r
        )
        self.worker_memory = Gauge(
            "specwhisper_worker_resident_memory_bytes", "the worker process's resident set (local worker)", registry=r
        )
        self.worker_batch_peak = Gauge(
            "specwhisper_worker_batch_peak_memory_bytes",
            "the worker's highest resident peak over a batch since it started",
            registry=r,
        )
        self.worker_memory_budget = Gauge(
            "specwhisper_worker_memory_budget_bytes",
            "the worker's memory budget (SPECWHISPER_WORKER_MEMORY_MB)",
            registry=r,
        )
        self.batch_clips_limit = Gauge(
            "specwhisper_batch_clips_limit",
            "most clips a batch holds now (max_batch, or what the memory budget allows)",
            registry=r,
        )
        self.model_load_seconds = Gauge("specwhisper_model_load_seconds", "model load time of the worker", registry=r)
        self.engine = Info(
            "specwhisper_engine", "what the worker runs: models, device, threads, dtypes, kernels", registry=r
        )
        self.requests_cancelled = Counter(
            "specwhisper_requests_cancelled", "requests whose client disconnected before the answer", registry=r
        )
        self.queue_dropped = Counter(
            "specwhisper_queue_dropped", "queued requests dropped before running (their client went away)", registry=r
        )
        self.running_cancelled = Counter(
            "specwhisper_running_cancelled",
            "running requests stopped in the worker before their audio was done (their client went away)",
            registry=r,
        )
        self.partials_preempted = Counter(
            "specwhisper_realtime_partials_preempted",
            "live partials stopped in the worker to make room for a finished utterance",
            registry=r,
        )
        self.background_preempted = Counter(
            "specwhisper_long_upload_jobs_preempted",
            "jobs of long uploads stopped in the worker mid-window to let a short upload or a live final run first"
            " (each runs again, and is not stopped twice)",
            registry=r,
        )
        self.inner_batches = Counter(
            "specwhisper_inner_batches",
            "batches of short jobs the worker ran inside a running batch of long uploads' jobs (which then went on)",
            registry=r,
        )
        self.asyncio_tasks = Gauge("specwhisper_asyncio_tasks", "asyncio tasks in the web process", registry=r)
        self.asyncio_tasks.set_function(_task_count)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, ... of the web process

    def observe_batch(self, mode: str | None, costs: Mapping[tuple[str, int], float]) -> None:
        """A decoded batch: the mode it ran in (None: no valid row) and the adaptive policy's estimates
        after it, in ms per plain pass by (mode, batch size)."""
        if mode is not None:
            self.batches.labels(mode).inc()
        for (cost_mode, batch), ms in costs.items():
            self.mode_cost.labels(cost_mode, str(batch)).set(ms)


def _task_count() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # collected outside the event loop
        return 0.0


def samples_by_name(families: Iterable[Metric]) -> Samples:
    """Samples by sample name (`specwhisper_requests_total`, `..._bucket`, `..._count`, gauges' own names), from
    a registry's `collect()` or a parsed exposition.

    A metric without samples yet (labelled, and no label set used so far) is there with none, under the
    name its samples will have (counters with `_total`).
    """
    out: Samples = {}
    for family in families:
        if not family.samples:
            out.setdefault(f"{family.name}_total" if family.type == "counter" else family.name, [])
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out
