"""The worker's inbox over a real pipe: batches in order, one taken up inside another without the stop, and a job's
cancellation kept while its batch runs and cleared when its id comes again."""

from __future__ import annotations

import multiprocessing
import queue
import time

import numpy as np
import pytest

from app.api.types import DecodingOptions
from app.server.worker.inbox import Inbox
from app.server.worker.protocol import BatchRequest, Cancel, Job, Stop


def _batch(batch_id: int, *ids: str) -> BatchRequest:
    return BatchRequest(batch_id, [Job(i, np.zeros(160, np.float32), DecodingOptions()) for i in ids])


def _next(inbox: Inbox) -> int:
    batch = inbox.next(timeout=5)
    assert batch is not None
    return batch.batch_id


def _until(condition: object) -> None:
    for _ in range(400):
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.005)
    raise AssertionError("the inbox did not get there")


def test_batches_cancellations_and_the_stop() -> None:
    web, worker = multiprocessing.Pipe()
    inbox = Inbox(worker)
    with pytest.raises(queue.Empty):
        inbox.next(timeout=0.01)
    assert inbox.waiting() is None

    web.send(_batch(1, "long"))
    assert _next(inbox) == 1
    web.send(Cancel("long", keep=True))  # preempted: stopped, not forgotten
    web.send(_batch(2, "short"))
    taken: list[BatchRequest] = []

    def take() -> bool:
        inner = inbox.waiting()
        if inner is not None:
            taken.append(inner)
        return bool(taken)

    _until(take)  # taken up inside batch 1
    assert taken[0].batch_id == 2
    assert inbox.is_cancelled("long") and not inbox.is_cancelled("short")  # batch 2 leaves batch 1's stop
    assert inbox.forgotten() == []

    web.send(_batch(3, "long"))  # the preempted job again: its earlier stop no longer holds
    _until(lambda: not inbox.is_cancelled("long"))
    assert _next(inbox) == 3
    web.send(Cancel("gone"))
    _until(lambda: inbox.is_cancelled("gone"))
    assert inbox.forgotten() == ["gone"]
    inbox.settle()  # nothing runs or waits: the cancellations noted are of finished jobs
    assert not inbox.is_cancelled("gone")

    web.send(Stop())
    _until(lambda: inbox.waiting() is None and len(inbox._batches) == 1)
    assert inbox.waiting() is None  # the stop is never taken up inside a batch
    assert inbox.next(timeout=5) is None
