"""The worker process: loads the models once, keeps them resident, runs batches from the web process."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from app.api.audio import SAMPLE_RATE, AudioError
from app.api.types import InvalidRequestError, Metrics, Segment, Transcription, Voice
from app.engine.heap import heap_trimmer
from app.server.memory import ProcessMemory, reset_peak
from app.server.worker.budget import MemoryBudgetError, warm_up_within
from app.server.worker.inbox import Inbox
from app.server.worker.policy import BatchCost, Mode, ModePolicy
from app.server.worker.protocol import (
    BatchRequest,
    BatchResult,
    Heartbeat,
    Job,
    JobResult,
    LoadFailed,
    Progress,
    Ready,
)
from app.settings import Settings
from app.speakers.embedders import SpeakerEmbedder, load_embedder, prints

if TYPE_CHECKING:  # the web process imports this module for `worker_main`, and must not load torch
    from app.engine.engine import Engine
    from app.engine.longform import LongFormJob

log = logging.getLogger("specwhisper.worker")

IDLE_BEFORE_TRIM_S = 0.25  # under load the next batch comes sooner, so a busy worker never trims
HEARTBEAT_S = 1.0


@dataclass
class _Transcription:
    """A job in the engine, between its batches: its windows so far, and its time in the engine."""

    job: LongFormJob
    engine_s: float = 0.0
    voices: list[Voice] = dataclasses.field(default_factory=list)  # its voice prints, when it asked for them


class BatchRunner:
    """Runs one batch at a time: validation, the speculative/plain choice, streaming progress, error isolation.

    A job decodes at most `windows` 30-s windows per batch (0: all of them): one still going is kept here and
    answered `suspended`; the web process queues it again (`resume`), so that other requests join the batches
    of an hour-long upload instead of waiting for all of it. `forgotten()` names suspended jobs whose clients
    left.

    A job may ask for voice prints of its speech (`Job.prints`, for diarization): they are taken when it starts,
    by the speaker embedder (`make_embedder`, loaded on the first such job), and answered with its transcription.

    A batch that comes while one runs (`waiting()`: the web process sends one only to go before a batch of long
    uploads' jobs) runs inside it, at the running batch's next heartbeat (an encoder layer or a decoder pass), and
    is answered at once; the running batch then goes on where it was, its state untouched. One level deep: a batch
    that comes during the inner one waits for its turn. A batch that hosted one is not measured for the policy.
    """

    def __init__(
        self,
        engine: Engine,
        policy: ModePolicy,
        send: Callable[[object], None],
        cancelled: Callable[[str], bool] = lambda request_id: False,
        *,
        windows: int = 0,
        forgotten: Callable[[], list[str]] = list,
        make_embedder: Callable[[], SpeakerEmbedder] = load_embedder,
        waiting: Callable[[], BatchRequest | None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.send = send
        self.cancelled = cancelled
        self.windows = windows
        self.forgotten = forgotten
        self.make_embedder = make_embedder
        self._embedder: SpeakerEmbedder | None = None
        self.waiting = waiting
        self.suspended: dict[str, _Transcription] = {}
        self._last_beat = 0.0
        self._depth = 0  # batches running: 2 while one runs inside another
        self._nested = 0  # clips of the batches run inside the current outer one
        self._hosting = False  # the outer batch may have a batch run inside it

    @property
    def embedder(self) -> SpeakerEmbedder:
        if self._embedder is None:
            self._embedder = self.make_embedder()
        return self._embedder

    def _heartbeat(self) -> None:
        """Called by the engine many times a window: tells the supervisor (at most once a second) that
        the batch moves."""
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.send(Heartbeat())
        if self._depth == 1 and self._hosting and (inner := self.waiting()) is not None:
            self._nested += len(inner.jobs)
            try:
                answer = self.run(inner)
            except Exception as exc:  # answered whatever happens, and the long batch goes on
                log.exception("batch %s failed", inner.batch_id)
                failed = [JobResult(j.request_id, error=f"internal error: {exc}", internal=True) for j in inner.jobs]
                answer = BatchResult(inner.batch_id, failed)
            self.send(answer)

    def forget(self) -> None:
        """Let go of the suspended jobs whose clients left."""
        for request_id in self.forgotten():
            self.suspended.pop(request_id, None)

    def run(self, batch: BatchRequest) -> BatchResult:
        self._depth += 1
        if self._depth == 1:
            self._nested = 0
            self._hosting = all(job.background for job in batch.jobs)  # only long uploads' jobs make room
        try:
            result = self._run(batch)
        finally:
            self._depth -= 1
        return dataclasses.replace(result, nested_clips=self._nested) if self._depth == 0 else result

    def _run(self, batch: BatchRequest) -> BatchResult:
        self.forget()
        valid: list[tuple[Job, _Transcription]] = []
        results: dict[str, JobResult] = {}
        mode: Mode | None = None
        for job in batch.jobs:
            try:
                if job.prints is not None and job.prints.only:
                    results[job.request_id] = self._prints_only(job)
                    continue
                valid.append((job, self._start(job)))
            except (InvalidRequestError, AudioError) as exc:  # a bad request fails alone, not its batch
                results[job.request_id] = JobResult(job.request_id, error=str(exc))
            except Exception as exc:
                log.exception("job %s could not start", job.request_id)
                results[job.request_id] = JobResult(job.request_id, error=f"internal error: {exc}", internal=True)
        if valid:
            mode, done = self._transcribe(valid, batch.batch_id)
            results.update(done)
        return BatchResult(batch.batch_id, [results[j.request_id] for j in batch.jobs], mode, self.policy.estimates())

    def _start(self, job: Job) -> _Transcription:
        if job.resume and job.request_id in self.suspended:
            return self.suspended.pop(job.request_id)
        if job.resume and job.stream:  # its segments so far were sent: from the start they would be sent twice
            raise RuntimeError("its transcription so far was lost (the worker restarted)")
        if job.resume:  # a new worker: the job starts again from its audio, to the same answer
            log.warning(
                "job %s: its transcription so far was lost (the worker restarted); starting again", job.request_id
            )
        samples = job.decoded()
        self.engine.check(job.options, samples)
        voices = prints(self.embedder, samples, job.prints.pieces) if job.prints is not None else []
        return _Transcription(self.engine.start(samples, job.options), voices=voices)

    def _prints_only(self, job: Job) -> JobResult:
        """A job that asks for voice prints only: answered at once, with an empty transcription."""
        assert job.prints is not None
        started = time.perf_counter()
        samples = job.decoded()
        voices = prints(self.embedder, samples, job.prints.pieces)
        seconds = samples.size / SAMPLE_RATE
        metrics = Metrics.none(seconds, (time.perf_counter() - started) * 1000)
        empty = Transcription("", [], None, None, seconds, [], "stop", metrics, voices=voices)
        return JobResult(job.request_id, empty)

    def _transcribe(self, batch: list[tuple[Job, _Transcription]], batch_id: int) -> tuple[Mode, dict[str, JobResult]]:
        jobs = [j for j, _ in batch]
        running = [t.job for _, t in batch]
        eligible = self.engine.drafter is not None and any(j.options.use_assistant for j in jobs)
        rows = sum(j.options.rows for j in jobs)  # what a pass carries: a beam's hypotheses count one each
        mode: Mode = self.policy.choose(rows) if eligible else "plain"
        for job, t in batch:
            t.job.options = dataclasses.replace(
                t.job.options, use_assistant=job.options.use_assistant and mode == "speculative"
            )
        before = [(t.counters.tokens, t.counters.windows, t.counters.decode_s) for t in running]

        def progress(i: int, segments: list[Segment]) -> None:
            if jobs[i].stream:
                self.send(Progress(jobs[i].request_id, segments))

        started, nested = time.perf_counter(), self._nested
        try:
            self.engine.advance(
                running,
                windows=self.windows or None,
                on_segments=progress,
                cancelled=lambda i: self.cancelled(jobs[i].request_id),
                heartbeat=self._heartbeat,
            )
        except Exception as exc:  # a bug must fail its batch, not the worker
            log.exception("batch %s failed", batch_id)
            return mode, {
                j.request_id: JobResult(j.request_id, error=f"internal error: {exc}", internal=True) for j in jobs
            }
        elapsed = time.perf_counter() - started
        if eligible and self._nested == nested:  # what this batch did (alone): the rows share its decode time
            done = [(t.counters.tokens - a, t.counters.windows - b, t.counters.decode_s - c)
                    for t, (a, b, c) in zip(running, before, strict=True)]  # fmt: skip
            cost = BatchCost.of(max(d for _, _, d in done), [(tokens, windows) for tokens, windows, _ in done])
            self.policy.observe(mode, rows, cost)
            log.debug(
                "batch %s: %d rows %s, %.0f ms for %d plain passes; estimates %s",
                batch_id, rows, mode, cost.seconds * 1000, cost.plain_passes, self.policy.snapshot(),
            )  # fmt: skip
        results = {}
        for job, t in batch:
            t.engine_s += elapsed
            if t.job.done:
                transcription = self.engine.finish(t.job, t.engine_s, len(batch))
                if t.voices:
                    transcription = dataclasses.replace(transcription, voices=t.voices)
                results[job.request_id] = JobResult(job.request_id, transcription)
            else:
                self.suspended[job.request_id] = t
                results[job.request_id] = JobResult(job.request_id, suspended=True)
        return mode, results


def leave_the_server_group() -> None:
    """Leave the web process's process group (not its session), but die with the web process.

    The web process decides when we stop: it drains its requests first, which needs us. So a signal
    sent to the server's process group (`timeout`, `kill -TERM -- -PGID`) must reach the web process
    only; before, such a SIGTERM killed the worker mid-batch, failed the requests being drained and
    had the worker restarted during shutdown. A terminal's Ctrl+C, Ctrl+Z and hang-up go to its
    foreground group only, so they too reach the web process alone; writing to the terminal from a
    background group (SIGTTOU, under `stty tostop`) is allowed here. In exchange, a signal that kills
    the whole group no longer kills us: on Linux the kernel sends us SIGKILL when the web process dies
    (elsewhere the inbox sees the pipe close and the running batch stops at its next window).

    A group of our own, not a session: where the kernel shares the CPU out by session first (Linux's
    `sched_autogroup`, on by default on many distributions), a session of our own split the cores
    evenly between the two processes whatever their threads. On 2 cores, a busy upload thread of the
    web process then kept a core to itself, and the worker's two threads shared the other, each of
    their parallel regions waiting for a time slice: a 0.17-s batch took 13 s. In one session, the
    upload threads' lower priority (`serving.admission.lower_priority`) gives the worker the cores.
    """
    parent = os.getppid()
    os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def worker_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the worker process (spawned)."""
    leave_the_server_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the web process decides when we stop
    from huggingface_hub.utils import disable_progress_bars

    from app.engine.build import build_engine
    from app.store.loader import is_settings_error

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    disable_progress_bars()  # hub downloads: this process's output is the server's log
    try:
        engine = build_engine(settings, progress=False)
        trimmer = heap_trimmer()
        trim = trimmer if settings.worker_heap_trim else None
        plan = None
        if settings.worker_memory_mb is None:
            warmed = engine.warm_up({1, settings.max_batch})
        else:  # the budget measures the idle worker trimmed, whether or not idle trimming is on
            warmed, plan = warm_up_within(engine, settings.worker_memory_mb, settings.max_batch, trimmer)
        described = engine.describe()
    except Exception as exc:
        permanent = is_settings_error(exc) or isinstance(exc, MemoryBudgetError)
        if permanent:
            error = str(exc)  # the supervisor logs it
        else:
            log.exception("cannot load the models")
            error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):  # the web process may be gone
            conn.send(LoadFailed(error, permanent))
        sys.exit(1)
    inbox = Inbox(conn)
    policy = ModePolicy(settings.speculation, warmed=warmed)
    runner = BatchRunner(
        engine,
        policy,
        conn.send,
        inbox.is_cancelled,
        windows=settings.windows_per_turn,
        forgotten=inbox.forgotten,
        make_embedder=lambda: load_embedder(settings.speaker_embedder),
        waiting=inbox.waiting,
    )
    conn.send(Ready(time.perf_counter() - started, described, plan))
    while True:
        try:
            batch = inbox.next(timeout=IDLE_BEFORE_TRIM_S)
        except queue.Empty:
            runner.forget()  # an abandoned suspended job's memory goes back too
            inbox.settle()
            if trim is not None:
                trim()
            batch = inbox.next()
        if batch is None:
            return
        measured = reset_peak()
        result = runner.run(batch)
        memory = ProcessMemory.of() if measured else None
        conn.send(result if memory is None else dataclasses.replace(result, peak_mb=memory.peak_mb))
