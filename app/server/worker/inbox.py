"""The worker's inbox: a reader thread takes the web process's messages off the pipe as they come, so that a
Cancel is noted mid-batch and a batch that comes while another runs can be taken up inside it."""

from __future__ import annotations

import collections
import queue
import threading
from multiprocessing.connection import Connection

from app.server.worker.protocol import BatchRequest, Cancel


class Inbox:
    """The worker's reader thread: batches queue up for the main thread; a Cancel is noted at once, mid-batch.

    A job's id may come again (a preempted job runs again, a suspended one resumes): a batch clears the earlier
    cancellations of its own jobs' ids, and only those (another batch may be running: `BatchRunner.waiting`).
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._batches: collections.deque[BatchRequest | None] = collections.deque()  # None: stop
        self._arrived = threading.Condition()
        self._cancelled: set[str] = set()
        self._forgotten: list[str] = []  # every Cancel: a suspended job of these ids is dropped
        self._orphaned = False  # the web process is gone: whatever runs is for no one
        threading.Thread(target=self._read, name="worker-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._orphaned = True
                message = None
            if isinstance(message, Cancel):
                self._cancelled.add(message.request_id)
                if not message.keep:
                    self._forgotten.append(message.request_id)
                continue
            if isinstance(message, BatchRequest):
                self._cancelled.difference_update(job.request_id for job in message.jobs)
            else:  # Stop, or the web process is gone
                message = None
            with self._arrived:
                self._batches.append(message)
                self._arrived.notify()
            if message is None:
                return

    def next(self, timeout: float | None = None) -> BatchRequest | None:
        """The next batch (None: stop); raises queue.Empty after `timeout` seconds without one."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: bool(self._batches), timeout):
                raise queue.Empty
            return self._batches.popleft()

    def waiting(self) -> BatchRequest | None:
        """The next batch if one has come (never the stop), without waiting."""
        with self._arrived:
            if self._batches and self._batches[0] is not None:
                return self._batches.popleft()
            return None

    def settle(self) -> None:
        """With no batch running or waiting, the cancellations noted are of finished jobs: let them go."""
        with self._arrived:
            if not self._batches:
                self._cancelled.clear()

    def forgotten(self) -> list[str]:
        """The ids cancelled since the last call."""
        taken, self._forgotten = self._forgotten, []
        return taken

    def is_cancelled(self, request_id: str) -> bool:
        return self._orphaned or request_id in self._cancelled
