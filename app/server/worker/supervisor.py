"""Runs the worker process from the web process: start, readiness, batches, death and restart."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from app.server.worker.client import NoUsableModel, WorkerUnavailable
from app.server.worker.process import worker_main
from app.server.worker.protocol import (
    BatchRequest,
    BatchResult,
    Cancel,
    Job,
    JobResult,
    LoadFailed,
    Progress,
    Ready,
    Stop,
)
from app.settings import Settings

log = logging.getLogger("specwhisper.supervisor")

MAX_RESTART_DELAY_S = 30.0


class WorkerSupervisor:
    """Owns one worker process; restarts it when it dies, failing its in-flight batch at once.

    The first death after a batch went through is answered by a restart at once; each further death
    without a batch in between waits longer (1, 2, 4 ... 30 s), so that a worker that crashes while
    loading, or on a request a client keeps resending, does not spin. A worker that finds the models
    unusable at the first start (LoadFailed, permanent) is not restarted: `on_fatal` gets its reason.

    A watchdog kills (and so restarts) a worker that is not ready within `worker_start_timeout_s`, or
    that sends nothing for `worker_stall_timeout_s` while a batch runs (its engine beats around each
    encoder run and after each main-model pass): a hung worker would otherwise hold every request
    behind it until its timeout, forever.
    """

    def __init__(
        self,
        settings: Settings,
        on_ready: Callable[[Ready], None] | None = None,
        on_batch: Callable[[BatchResult], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_ready = on_ready
        self.on_batch = on_batch
        self.on_fatal = on_fatal
        self.ready: Ready | None = None
        self.failure: str | None = None  # why the worker could not load the models, when it gave up
        self.restarts = 0
        self._ever_ready = False
        self._load_failed: LoadFailed | None = None
        self._deaths = 0  # since the last batch that went through
        self._restart: asyncio.TimerHandle | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._spawned_at = 0.0
        self._heard_at = 0.0  # the last message from the worker, or the last batch sent to it
        self._ids = itertools.count()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._inflight: dict[int, asyncio.Future[BatchResult]] = {}
        self._listeners: dict[int, Callable[[Progress], None]] = {}
        self._send_lock = asyncio.Lock()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_event = asyncio.Event()
        self._generation = 0

    @property
    def is_ready(self) -> bool:
        return self.ready is not None and not self._stopping

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")

    async def _watch(self) -> None:
        start_limit, stall_limit = self.settings.worker_start_timeout_s, self.settings.worker_stall_timeout_s
        while not self._stopping:
            await asyncio.sleep(min(1.0, start_limit / 4, stall_limit / 4))
            try:
                self._check_alive(start_limit, stall_limit)
            except Exception:  # the watchdog must outlive anything it meets
                log.exception("worker watchdog")

    def _check_alive(self, start_limit: float, stall_limit: float) -> None:
        proc = self._proc
        if proc is None or self._stopping or not proc.is_alive():
            return
        now = time.monotonic()
        if self.ready is None and now - self._spawned_at > start_limit:
            log.error("the worker is not ready after %.0f s; killing it", now - self._spawned_at)
        elif self._inflight and now - self._heard_at > stall_limit:
            log.error("the worker sent nothing for %.0f s during a batch; killing it as hung", now - self._heard_at)
        else:
            return
        proc.kill()  # its reader thread sees the pipe close: the batch fails and a new worker starts

    def check_ready(self) -> None:
        """Raise WorkerUnavailable (NoUsableModel when that is final) unless a batch can run now."""
        if self.failure is not None:
            raise NoUsableModel(f"the worker cannot load the models: {self.failure}")
        if not self.is_ready or self._conn is None:
            raise WorkerUnavailable("the worker is not ready")

    def _spawn(self) -> None:
        self._restart = None
        if self._stopping:
            return
        self._load_failed = None
        ctx = mp.get_context("spawn")
        parent = child = None
        try:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(self.settings, child), name="specwhisper-worker", daemon=True)
            proc.start()
        except OSError:  # out of file descriptors, processes or memory: try again later
            for end in (parent, child):
                if end is not None:
                    end.close()
            log.exception("could not start the worker")
            self._schedule_restart()
            return
        child.close()
        self._spawned_at = time.monotonic()
        self._generation += 1
        self._proc, self._conn = proc, parent
        self.ready = None
        self._ready_event.clear()
        reader = threading.Thread(target=self._read, args=(parent, proc, self._generation), name="worker-reader")
        reader.daemon = True
        reader.start()
        log.info("worker started (pid %s)", proc.pid)

    async def wait_ready(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        return self.is_ready

    def _read(self, conn: Connection, proc: BaseProcess, generation: int) -> None:
        """Reader thread: hands every message to the event loop; EOF means the worker is gone."""
        assert self._loop is not None
        while True:
            try:
                message = conn.recv()
            except Exception as exc:
                if not isinstance(exc, EOFError | OSError):  # a message that cannot be read: end this worker
                    log.exception("unreadable message from the worker; killing it")
                # Here, not on the event loop: its exit code is then known, and it is gone before a new one.
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                self._loop.call_soon_threadsafe(self._on_exit, generation)
                return
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: object) -> None:
        self._heard_at = time.monotonic()  # any message, a Heartbeat included, shows the worker alive
        if isinstance(message, Ready):
            self.ready = message
            self._ever_ready = True
            self._ready_event.set()
            log.info(
                "worker ready: %s (assistant %s) in %.1f s", message.model, message.assistant, message.load_seconds
            )
            if self.on_ready:
                self.on_ready(message)
        elif isinstance(message, LoadFailed):
            self._load_failed = message
        elif isinstance(message, Progress):
            for listener in self._listeners.values():
                listener(message)
        elif isinstance(message, BatchResult):
            self._deaths = 0
            if self.on_batch:
                self.on_batch(message)
            self._listeners.pop(message.batch_id, None)
            future = self._inflight.pop(message.batch_id, None)
            if future is not None and not future.done():
                future.set_result(message)

    def _on_exit(self, generation: int) -> None:
        if generation != self._generation:
            return
        self.ready = None
        self._ready_event.clear()
        failed = list(self._inflight.values())
        self._inflight.clear()
        self._listeners.clear()
        for future in failed:
            if not future.done():
                future.set_exception(WorkerUnavailable("the worker process died while transcribing"))
        if self._stopping:
            return
        code = self._proc.exitcode if self._proc is not None else None
        if self._load_failed is not None and self._load_failed.permanent and not self._ever_ready:
            self.failure = self._load_failed.error
            log.critical("the worker cannot load the models, so it is not restarted: %s", self.failure)
            if self.on_fatal:
                self.on_fatal(self.failure)
            return
        delay = self._schedule_restart()
        log.error("worker exited (code %s); restarting in %.0f s, %d batch(es) failed", code, delay, len(failed))

    def _schedule_restart(self) -> float:
        self._deaths += 1
        delay = 0.0 if self._deaths == 1 else min(MAX_RESTART_DELAY_S, 2.0 ** (self._deaths - 2))
        self.restarts += 1
        assert self._loop is not None
        self._restart = self._loop.call_later(delay, self._spawn)
        return delay

    async def run(self, jobs: list[Job], on_progress: Callable[[Progress], None] | None = None) -> list[JobResult]:
        """Run one batch; `on_progress` receives the Progress messages of its streaming jobs."""
        self.check_ready()
        assert self._conn is not None
        loop = asyncio.get_running_loop()
        batch_id = next(self._ids)
        future: asyncio.Future[BatchResult] = loop.create_future()
        self._inflight[batch_id] = future
        self._heard_at = time.monotonic()  # the stall clock starts with each batch
        if on_progress is not None:
            self._listeners[batch_id] = on_progress
        conn = self._conn
        try:
            async with self._send_lock:
                await asyncio.to_thread(conn.send, BatchRequest(batch_id, jobs))
        except (OSError, ValueError) as exc:
            self._inflight.pop(batch_id, None)
            self._listeners.pop(batch_id, None)
            raise WorkerUnavailable(f"could not reach the worker: {exc}") from exc
        result = await future
        return result.results

    async def cancel(self, request_id: str, *, keep: bool = False) -> None:
        """Ask the worker to stop a running job at its next window (best effort: it may have finished); `keep`: keep
        it if it ends suspended (it was only preempted)."""
        conn = self._conn
        if conn is None or not self.is_ready:
            return
        with contextlib.suppress(OSError, ValueError):
            async with self._send_lock:
                await asyncio.to_thread(conn.send, Cancel(request_id, keep))

    async def stop(self, timeout: float = 10.0) -> None:
        """A ready worker finishes its batch and exits; one still loading (it reads no messages yet) is
        terminated at once."""
        self._stopping = True
        if self._restart is not None:
            self._restart.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            return
        if self.ready is not None:
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(conn.send, Stop())
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if proc.is_alive():
            proc.terminate()
            await asyncio.to_thread(proc.join, 5)
        if proc.is_alive():
            proc.kill()
        conn.close()
