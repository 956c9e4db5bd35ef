"""The batcher's lanes: finished live utterances first, then uploads, then partials; a partial that waited too
long goes before uploads, never before a finished utterance (it would hold up the final a speaker waits for)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from app.api.types import DecodingOptions
from app.server.metrics import ServerMetrics
from app.server.worker.batcher import Batcher, Lane
from app.server.worker.protocol import Job


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
