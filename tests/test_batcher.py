"""The batcher's lanes: finished live utterances first, then uploads, then partials; a partial that waited too
long goes before uploads, never before a finished utterance (it would hold up the final a speaker waits for);
a finished utterance preempts a running batch of partials."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from app.api.types import DecodingOptions, Metrics, Transcription
from app.server.metrics import ServerMetrics
from app.server.worker.batcher import Batcher, Lane
from app.server.worker.client import Preempted
from app.server.worker.protocol import Job, JobResult


class AlwaysReady:
    """The worker supervisor's readiness check, the one part of it `submit` uses."""

    def check_ready(self) -> None:
        return None


def _job(name: str) -> Job:
    return Job(name, np.zeros(1600, np.float32), DecodingOptions())


def test_lane_order_and_aged_partials() -> None:
    async def run() -> list[Any]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16,  # type: ignore[arg-type]
                          partial_max_wait_s=0.05)  # fmt: skip
        partial = batcher.submit(_job("partial"), Lane.LIVE_PARTIAL)
        upload = batcher.submit(_job("upload"), Lane.UPLOAD)
        fresh = [batcher._take() for _ in range(2)]  # a fresh partial waits behind the upload
        batcher.lanes[Lane.LIVE_PARTIAL].appendleft(partial)
        batcher.lanes[Lane.UPLOAD].appendleft(upload)
        time.sleep(0.06)  # the partial has now waited too long
        final = batcher.submit(_job("final"), Lane.LIVE_FINAL)
        aged = [batcher._take() for _ in range(4)]
        return [fresh == [upload, partial], aged == [final, partial, upload, None]]

    assert asyncio.run(run()) == [True, True]


def test_batches_count_rows() -> None:
    """A beam-5 request takes five rows of a batch: with room for 10, two of them fill one batch and a third waits
    for the next, in order; greedy requests take one row each; a request wider than the room runs alone."""

    def beam(name: str, size: int = 5) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(beam_size=size, temperature=(0.0, 0.2)))

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16,  # type: ignore[arg-type]
                          max_rows=10)  # fmt: skip
        for job in (beam("b1"), beam("b2"), _job("g1"), beam("b3"), _job("g2"), beam("wide", 16), _job("g3")):
            batcher.submit(job, Lane.UPLOAD)
        return [[p.job.request_id for p in await batcher._collect()] for _ in range(4)]

    assert asyncio.run(run()) == [["b1", "b2"], ["g1", "b3", "g2"], ["wide"], ["g3"]]
    assert DecodingOptions(beam_size=5).rows == 5 and DecodingOptions(beam_size=5, temperature=0.4).rows == 5
    assert DecodingOptions(temperature=0.4, best_of=3).rows == 3 and DecodingOptions().rows == 1


def test_a_short_upload_goes_before_the_later_chunks_of_long_ones() -> None:
    """Two chunked uploads queue their chunks (turns 0..5), then a one-job upload arrives: it joins the first batch
    that has room, before either long upload's later chunks; the long ones take turns, chunk by chunk."""

    def chunk(name: str, turn: int) -> Job:
        return Job(f"{name}-{turn}", np.zeros(1600, np.float32), DecodingOptions(), turn=turn)

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=2, window_s=0.0, queue_size=32)  # type: ignore[arg-type]
        for turn in range(6):
            batcher.submit(chunk("a", turn), Lane.UPLOAD)
        for turn in range(6):
            batcher.submit(chunk("b", turn), Lane.UPLOAD)
        batcher.submit(_job("short"), Lane.UPLOAD)
        return [[p.job.request_id for p in await batcher._collect()] for _ in range(3)]

    assert asyncio.run(run()) == [["a-0", "b-0"], ["short", "a-1"], ["b-1", "a-2"]]


class HeldWorker:
    """The worker supervisor as the batcher uses it: each batch runs until the test releases it; cancellations
    sent to the worker are recorded."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    def check_ready(self) -> None:
        return None

    async def run(self, jobs: list[Job], on_progress: Any = None) -> list[JobResult]:
        self.ran.append([job.request_id for job in jobs])
        await self.release.wait()
        self.release.clear()
        return [JobResult(job.request_id, error="not decoded here") for job in jobs]

    async def cancel(self, request_id: str, *, keep: bool = False) -> None:
        self.cancelled.append(request_id)


async def _until(condition: Any) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the batcher did not get there")


def test_a_finished_utterance_preempts_a_batch_of_partials() -> None:
    """A final that arrives while the worker runs partials only: the partials are refused (Preempted, a 429 to
    the serving layer, which skips a partial) and stopped in the worker; the final runs next. A batch holding
    anything else is left to finish."""

    async def run() -> None:
        worker = HeldWorker()
        metrics = ServerMetrics()
        batcher = Batcher(worker, metrics, max_batch=4, window_s=0.0, queue_size=16)  # type: ignore[arg-type]
        batcher.start()
        partials = [batcher.submit(_job(f"partial{i}"), Lane.LIVE_PARTIAL) for i in range(2)]
        await _until(lambda: worker.ran == [["partial0", "partial1"]])
        final = batcher.submit(_job("final"), Lane.LIVE_FINAL)
        for p in partials:
            assert isinstance(p.future.exception(), Preempted)
        await _until(lambda: worker.cancelled == ["partial0", "partial1"])  # sent to the worker
        assert metrics.partials_preempted._value.get() == 2
        worker.release.set()
        await _until(lambda: len(worker.ran) == 2)
        assert worker.ran[1] == ["final"] and not final.future.done()

        # A running upload is not stopped for a final: the final waits its turn.
        worker.release.set()
        await _until(lambda: final.future.done())
        upload = batcher.submit(_job("upload"), Lane.UPLOAD)
        await _until(lambda: len(worker.ran) == 3)
        batcher.submit(_job("final2"), Lane.LIVE_FINAL)
        assert not upload.future.done() and worker.cancelled == ["partial0", "partial1"]
        worker.release.set()
        await _until(lambda: upload.future.done() and len(worker.ran) == 4)
        assert worker.ran[3] == ["final2"]
        worker.release.set()
        await batcher.drain(1.0)

    asyncio.run(run())


def test_finished_utterances_and_partials_never_share_a_batch() -> None:
    """Queued together, a final and partials run apart: the final (with an upload) first, then the partials. A final
    that arrives while a batch of partials is still gathering (its window open) leads instead of joining it."""

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16)  # type: ignore[arg-type]
        for name, lane in (("p1", Lane.LIVE_PARTIAL), ("f1", Lane.LIVE_FINAL), ("p2", Lane.LIVE_PARTIAL),
                           ("u1", Lane.UPLOAD)):  # fmt: skip
            batcher.submit(_job(name), lane)
        batches = [[p.job.request_id for p in await asyncio.wait_for(batcher._collect(), 5)] for _ in range(2)]

        gathering = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=1.0, queue_size=16)  # type: ignore[arg-type]
        gathering.submit(_job("p3"), Lane.LIVE_PARTIAL)
        collecting = asyncio.ensure_future(gathering._collect())
        await asyncio.sleep(0.05)  # the partial's batch waits for company
        gathering.submit(_job("f2"), Lane.LIVE_FINAL)
        gathering.submit(_job("p4"), Lane.LIVE_PARTIAL)
        first = [p.job.request_id for p in await asyncio.wait_for(collecting, 5)]
        after = [p.job.request_id for p in await asyncio.wait_for(gathering._collect(), 5)]
        return [*batches, first, after]

    assert asyncio.run(run()) == [["f1", "u1"], ["p1", "p2"], ["f2"], ["p3", "p4"]]


class StoppingWorker(HeldWorker):
    """A HeldWorker whose jobs stopped by a `keep` cancel (preempted) end "cancelled", as the engine ends them."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: set[str] = set()

    async def cancel(self, request_id: str, *, keep: bool = False) -> None:
        await super().cancel(request_id)
        if keep:
            self.kept.add(request_id)

    async def run(self, jobs: list[Job], on_progress: Any = None) -> list[JobResult]:
        await super().run(jobs, on_progress)
        zero = Metrics(0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0.0, 0, 0, 0.0, 0.0, False, batch_size=0, windows=0)
        stopped = Transcription("", [], None, None, 0.0, [], "cancelled", zero)
        results = [
            JobResult(
                j.request_id,
                stopped if j.request_id in self.kept else None,
                error=None if j.request_id in self.kept else "x",
            )
            for j in jobs
        ]
        self.kept.clear()  # a new batch clears the cancellations of the last, as the worker's inbox does
        return results


def test_a_short_upload_preempts_long_uploads_once_where_it_cannot_run_inside() -> None:
    """Long uploads' jobs (`background`) run apart from short ones. A short upload that arrives while a batch of them
    runs, and finds no room inside it (two of a `max_batch` of two), has it stopped in the worker; it runs alone, then
    the stopped jobs run again, first in their lane, and are not stopped a second time: the next short upload waits
    for them. A long upload's resumed job is never stopped."""

    def long(name: str, **fields: Any) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(), background=True, **fields)

    async def run() -> None:
        worker, metrics = StoppingWorker(), ServerMetrics()
        batcher = Batcher(worker, metrics, max_batch=2, window_s=0.0, queue_size=16)  # type: ignore[arg-type]
        batcher.submit(long("a-0"), Lane.UPLOAD)
        batcher.submit(long("b-0", turn=0), Lane.UPLOAD)
        batcher.start()
        await _until(lambda: worker.ran == [["a-0", "b-0"]])
        short = batcher.submit(_job("short"), Lane.UPLOAD)
        await _until(lambda: worker.cancelled == ["a-0", "b-0"])
        assert metrics.background_preempted._value.get() == 2
        worker.release.set()
        await _until(lambda: len(worker.ran) == 2)
        assert worker.ran[1] == ["short"]
        worker.release.set()
        await _until(lambda: short.future.done() and len(worker.ran) == 3)
        assert worker.ran[2] == ["a-0", "b-0"]  # again, and now for good
        batcher.submit(_job("short2"), Lane.UPLOAD)
        batcher.submit(long("c-1", turn=1), Lane.UPLOAD)
        assert worker.cancelled == ["a-0", "b-0"]
        worker.release.set()
        await _until(lambda: len(worker.ran) == 4)
        assert worker.ran[3] == ["short2"]  # c-1 arrived later but never shares its batch
        worker.release.set()
        await _until(lambda: len(worker.ran) == 5)
        assert worker.ran[4] == ["c-1"]
        worker.release.set()
        batcher.submit(long("d-0", resume=True), Lane.UPLOAD)
        await _until(lambda: len(worker.ran) == 6)
        batcher.submit(_job("short3"), Lane.UPLOAD)
        await asyncio.sleep(0.05)
        assert worker.cancelled == ["a-0", "b-0"]
        worker.release.set()
        await _until(lambda: len(worker.ran) == 7)
        worker.release.set()
        await batcher.drain(1.0)

    asyncio.run(run())


def test_long_uploads_batch_apart_and_in_smaller_batches() -> None:
    """Long uploads' jobs take at most `max_background` rows of a batch, and never share one with other jobs."""

    def long(name: str) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(), background=True)

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16, max_background=2)  # type: ignore[arg-type]
        for job in (long("a"), long("b"), long("c"), _job("s1"), _job("s2")):
            batcher.submit(job, Lane.UPLOAD)
        return [[p.job.request_id for p in await batcher._collect()] for _ in range(3)]

    assert asyncio.run(run()) == [["s1", "s2"], ["a", "b"], ["c"]]


def test_a_partial_waits_for_a_gathering_batch_of_long_uploads() -> None:
    """A long upload's job gathering a batch, and a fresh partial queued: the partial neither joins nor leads it (it
    would not go first), it runs next; a short upload that arrives while the long ones gather leads instead."""

    def long(name: str) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(), background=True)

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16)  # type: ignore[arg-type]
        batcher.submit(long("a"), Lane.UPLOAD)
        batcher.submit(_job("partial"), Lane.LIVE_PARTIAL)
        batches = [[p.job.request_id for p in await asyncio.wait_for(batcher._collect(), 5)] for _ in range(2)]

        gathering = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=1.0, queue_size=16)  # type: ignore[arg-type]
        gathering.submit(long("b"), Lane.UPLOAD)
        collecting = asyncio.ensure_future(gathering._collect())
        await asyncio.sleep(0.05)
        gathering.submit(_job("short"), Lane.UPLOAD)
        first = [p.job.request_id for p in await asyncio.wait_for(collecting, 5)]
        return [*batches, first]

    assert asyncio.run(run()) == [["a"], ["partial"], ["short"]]


def test_the_memory_budget_caps_every_batch() -> None:
    """The clips a worker's memory budget allows cap every batch, short uploads' and long uploads' alike."""

    def long(name: str) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(), background=True)

    async def run() -> list[list[str]]:
        batcher = Batcher(AlwaysReady(), ServerMetrics(), max_batch=4, window_s=0.0, queue_size=16, max_background=2)  # type: ignore[arg-type]
        batcher.memory_cap = 1
        for job in (long("a"), long("b"), _job("s1"), _job("s2"), _job("s3")):
            batcher.submit(job, Lane.UPLOAD)
        return [[p.job.request_id for p in await batcher._collect()] for _ in range(5)]

    assert asyncio.run(run()) == [["s1"], ["s2"], ["s3"], ["a"], ["b"]]


class NestingWorker:
    """The worker supervisor as the batcher uses it, with batches in flight at once (as the worker runs one inside
    another): each runs until the test releases it by its first job's id."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.cancelled: list[str] = []
        self.releases: dict[str, asyncio.Event] = {}

    def check_ready(self) -> None:
        return None

    def release(self, first: str) -> None:
        self.releases[first].set()

    async def run(self, jobs: list[Job], on_progress: Any = None) -> list[JobResult]:
        self.ran.append([job.request_id for job in jobs])
        event = self.releases.setdefault(jobs[0].request_id, asyncio.Event())
        await event.wait()
        return [JobResult(job.request_id, error="not decoded here") for job in jobs]

    async def cancel(self, request_id: str, *, keep: bool = False) -> None:
        self.cancelled.append(request_id)


def test_short_jobs_run_inside_a_batch_of_long_uploads() -> None:
    """A short upload that arrives while a batch of two long uploads' jobs runs is sent to the worker at once, to run
    inside it: nothing is stopped, and it is answered while the long batch still runs. A final and another short
    upload that come meanwhile go next, together (the room the long batch leaves of four), inside it still; a long
    job or a partial never goes inside. Once the long batch ends, the batcher goes on as before."""

    def long(name: str) -> Job:
        return Job(name, np.zeros(1600, np.float32), DecodingOptions(), background=True)

    async def run() -> None:
        worker, metrics = NestingWorker(), ServerMetrics()
        batcher = Batcher(worker, metrics, max_batch=4, window_s=0.0, queue_size=16)  # type: ignore[arg-type]
        batcher.submit(long("a"), Lane.UPLOAD)
        batcher.submit(long("b"), Lane.UPLOAD)
        batcher.start()
        await _until(lambda: worker.ran == [["a", "b"]])
        batcher.submit(long("c"), Lane.UPLOAD)
        partial = batcher.submit(_job("p"), Lane.LIVE_PARTIAL)
        short = batcher.submit(_job("s1"), Lane.UPLOAD)
        await _until(lambda: len(worker.ran) == 2)
        assert worker.ran[1] == ["s1"]  # sent at once, inside the long batch
        short2 = batcher.submit(_job("s2"), Lane.UPLOAD)
        final = batcher.submit(_job("f"), Lane.LIVE_FINAL)
        worker.release("s1")
        await _until(lambda: short.future.done() and len(worker.ran) == 3)
        assert worker.ran[2] == ["f", "s2"]  # the next inner batch: the final first, the second short upload with it
        worker.release("f")
        await _until(lambda: final.future.done() and short2.future.done())
        assert worker.cancelled == [] and metrics.background_preempted._value.get() == 0
        assert metrics.inner_batches._value.get() == 2 and batcher.inflight == 2
        assert not partial.future.done() and len(worker.ran) == 3  # a partial waits for the long batch; so does c
        worker.release("a")
        await _until(lambda: len(worker.ran) == 4)
        assert worker.ran[3] == ["c"]
        worker.release("c")
        await _until(lambda: len(worker.ran) == 5)
        assert worker.ran[4] == ["p"]
        worker.release("p")
        await batcher.drain(1.0)

    asyncio.run(run())
