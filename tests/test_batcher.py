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
