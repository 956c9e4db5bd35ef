"""The worker process: loads the models once, keeps them resident, runs batches from the web process."""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection

from app.engine.transcriber import Engine, InvalidRequestError
from app.server.protocol import BatchRequest, BatchResult, JobResult, Ready, Stop
from app.settings import Settings

log = logging.getLogger("specwhisper.worker")


def _run_batch(engine: Engine, batch: BatchRequest) -> BatchResult:
    valid, results = [], {}
    for job in batch.jobs:
        try:
            engine.check(job.options)
            valid.append(job)
        except InvalidRequestError as exc:
            results[job.request_id] = JobResult(job.request_id, error=str(exc))
    if valid:
        try:
            out = engine.transcribe([j.audio for j in valid], [j.options for j in valid])
        except Exception as exc:  # a bug must fail its batch, not the worker
            log.exception("batch %s failed", batch.batch_id)
            for job in valid:
                results[job.request_id] = JobResult(job.request_id, error=f"internal error: {exc}", internal=True)
        else:
            for job, transcription in zip(valid, out, strict=True):
                results[job.request_id] = JobResult(job.request_id, transcription=transcription)
    return BatchResult(batch.batch_id, [results[j.request_id] for j in batch.jobs])


def worker_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the worker process (spawned)."""
    from app.runtime import build_engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the web process decides when we stop
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    engine = build_engine(settings, progress=False)
    drafter = engine.drafter.name if engine.drafter else None
    conn.send(Ready(engine.main.name, drafter, time.perf_counter() - started))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(message, Stop):
            return
        if isinstance(message, BatchRequest):
            conn.send(_run_batch(engine, message))
