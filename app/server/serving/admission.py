"""What an upload may cost the web process: a share of its threads, and a place in the budget of audio in flight.

`FairShare` runs the blocking work of uploads (decoding, levelling, the VAD), one bounded step at a time, on
threads of their own (the event loop's default threads stay free), in three tiers by the CPU time a request's
steps have used so far, as a multilevel feedback queue does:
1. its first `PROMPT_S`: on a thread at the process's priority, so that a short upload is read at once, whatever
   the worker and long uploads do (most of them need a single step of a few ms);
2. up to `QUANTUM_S`: on a thread at a lower OS priority (`BACKGROUND_NICE`);
3. the rest: a request needs one of `threads` long places, given in the order the requests came, and its steps
   run on `threads` threads at the lower priority, the step of the request that has used the least time first:
   long uploads then finish one after another, holding their decoders' buffers one at a time, rather than all
   advancing together and all finishing last.
In each tier, the waiting step of the request that has used the least time goes first.
A request's time is the CPU time of its steps, not their wall time: a step slowed by the worker's threads (which
come first) costs its request no more of its share, so a short upload is not pushed out of its first tiers, behind
long ones, because the worker was busy while it was read.

Why two priorities. Past their first step, uploads' threads run below the worker's: on a 2-core machine an upload
thread at equal priority took a core from the worker's two OpenMP threads, each of whose parallel regions then
waited for a time slice. 20 long uploads arriving at once spent ~20 s of their first second at equal priority,
and short uploads' batches meanwhile took 4-6x their time in the worker (7 answers over 3x their idle latency in
the storm's first 25 s, against 1 at nice +10, none at +19: `python -m app storm`). But a step at +19 waits for
the worker: a short upload's reading, a few ms of CPU, took 0.2-0.9 s of the storm's answers while the worker ran,
and a live final arriving meanwhile went to the worker before it. `PROMPT_S` at the process's priority costs the
worker one short step per request (the storm's 20 long uploads arriving at once: at 0.1 s, 2 s of their reading at
the process's priority, and the short answer sent with them 3.2 s, 3.3x its idle latency).

`AudioBudget` admits uploads by the seconds of audio they hold at once: a chunked upload holds a few chunks and
blocks, whatever its length; a single-block upload holds all of it (decoded in the worker). A request that does
not fit waits in line; one that would make the line longer than the whole budget is refused (429). Short uploads
have a reserve of their own on top, so that long ones filling the budget never keep them waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


PROMPT_S = 0.02  # CPU time a request's steps get at the process's priority (a short upload's reading: a few ms)
QUANTUM_S = 1.0  # CPU time a request gets before it needs a long place
BACKGROUND_NICE = 19  # the upload threads' niceness, added to the process's (Linux's most: 19)


def lower_priority(nice: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's OS priority by `nice` (Linux: niceness is per thread, and inherited by the threads
    it starts, such as a decoder's); elsewhere, or where not allowed, nothing."""
    if not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


@dataclass
class Account:
    """One request's use of the upload threads (CPU seconds); `order`: when it came (`FairShare.account`)."""

    used: float = 0.0
    order: int = 0


class _Threads:
    """A few threads for blocking steps, each free one given to the waiting step of least `used` time (ties: the
    one that has waited longest)."""

    def __init__(self, threads: int, name: str, nice: int) -> None:
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix=name, initializer=functools.partial(lower_priority, nice) if nice else None
        )
        self._free = threads
        self._line: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._line if not f.done())

    async def run(self, used: float, step: Callable[[], T]) -> T:
        await self._turn(used)
        loop = asyncio.get_running_loop()
        try:
            future: Future[T] = self._executor.submit(step)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        return await asyncio.wrap_future(future)

    async def _turn(self, used: float) -> None:
        if self._free > 0 and not self._line:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._line, (used, next(self._order), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # given the thread just as it was cancelled: pass it on
                self._release()
            raise

    def _release(self) -> None:
        while self._line:
            _, _, turn = heapq.heappop(self._line)
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class FairShare:
    """Threads for the uploads' blocking steps. A request's first `PROMPT_S` of steps run on a thread of their own at
    the process's priority (a short upload is read at once, whatever long ones do), its steps up to `QUANTUM_S` on
    another below it (`BACKGROUND_NICE`); the rest on `threads` threads below it, given to the waiting step whose
    request has used the least time, and only to requests holding one of `threads` long places."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._prompt = _Threads(1, "upload-prompt", 0)
        self._first = _Threads(1, "upload-first", BACKGROUND_NICE)
        self._rest = _Threads(threads, "upload", BACKGROUND_NICE)
        self._arrivals = itertools.count()
        self._long: set[int] = set()  # the orders of the accounts holding a long place
        self._long_line: list[tuple[int, asyncio.Future[None]]] = []

    def account(self) -> Account:
        """A new request's account."""
        return Account(order=next(self._arrivals))

    @property
    def waiting(self) -> int:
        return self._prompt.waiting + self._first.waiting + self._rest.waiting

    async def run(self, account: Account, step: Callable[[], T]) -> T:
        """Run `step` on an upload thread when its turn comes. Cancelled while it runs, the step still finishes
        (a thread cannot be stopped) and keeps its thread until then."""
        threads = self._prompt if account.used < PROMPT_S else self._first
        if account.used >= QUANTUM_S:
            if account.order not in self._long:
                await self._long_place(account)
            threads = self._rest

        def timed() -> T:
            started = time.thread_time()
            try:
                return step()
            finally:
                account.used += time.thread_time() - started

        return await threads.run(account.used, timed)

    async def _long_place(self, account: Account) -> None:
        if len(self._long) < self.threads and not self._long_line:
            self._long.add(account.order)
            return
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._long_line, (account.order, place))
        try:
            await place  # `_hand_over` adds it to the holders
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():  # handed over just as it was cancelled: pass it on
                self.leave(account)
            raise

    def leave(self, account: Account) -> None:
        """The request runs no steps for now (it waits for something else, or it is done): its long place, if it
        holds one, goes to the earliest request waiting for one."""
        if account.order in self._long:
            self._long.discard(account.order)
            self._hand_over()

    def _hand_over(self) -> None:
        while self._long_line and len(self._long) < self.threads:
            order, place = heapq.heappop(self._long_line)
            if not place.done():
                self._long.add(order)
                place.set_result(None)

    def close(self) -> None:
        self._prompt.close()
        self._first.close()
        self._rest.close()


class OverBudget(Exception):
    """The line for the audio budget is full: try again after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)
class _Waiter:
    seconds: float
    admitted: asyncio.Future[None]


class AudioBudget:
    """At most `seconds` of audio held by uploads at once, and `reserve` more for short ones (`short_seconds` or
    less). A request that fits is admitted at once unless others wait (then only if it is short, so that a short
    upload never waits behind a long one); the others wait in line, first come first served, unless the line
    already holds `seconds` of audio: then OverBudget. A short request in line is admitted as soon as it fits,
    whatever waits before it. Used from the event loop only."""

    def __init__(
        self,
        seconds: float,
        short_seconds: float,
        on_change: Callable[[], None] | None = None,
        *,
        reserve: float = 0.0,
    ) -> None:
        self.seconds = seconds
        self.short_seconds = short_seconds
        self.reserve = reserve
        self.held = 0.0
        self._holders = 0
        self._line: list[_Waiter] = []
        self._on_change = on_change or (lambda: None)

    @property
    def waiting(self) -> int:
        return len(self._line)

    @property
    def waiting_seconds(self) -> float:
        return sum(w.seconds for w in self._line)

    @asynccontextmanager
    async def hold(self, seconds: float, retry_after: Callable[[], int]) -> AsyncIterator[None]:
        """Hold `seconds` (at most the whole budget) of the budget while the block runs; waits for room, or raises
        OverBudget (with `retry_after()` seconds) when the line is full."""
        seconds = min(seconds, self.seconds)
        if self._fits(seconds) and (not self._line or seconds <= self.short_seconds):
            self._take(seconds)
        else:
            if self.waiting_seconds + seconds > self.seconds:
                raise OverBudget(retry_after())
            waiter = _Waiter(seconds, asyncio.get_running_loop().create_future())
            self._line.append(waiter)
            self._on_change()
            try:
                await waiter.admitted
            except asyncio.CancelledError:
                if waiter in self._line:
                    self._line.remove(waiter)
                elif waiter.admitted.done() and not waiter.admitted.cancelled():
                    self._give_back(seconds)
                self._admit()
                raise
        self._on_change()
        try:
            yield
        finally:
            self._give_back(seconds)

    def _fits(self, seconds: float) -> bool:
        room = self.seconds + (self.reserve if seconds <= self.short_seconds else 0.0)
        return self.held + seconds <= room + 1e-9

    def _take(self, seconds: float) -> None:
        self.held += seconds
        self._holders += 1

    def _give_back(self, seconds: float) -> None:
        self._holders -= 1
        self.held = self.held - seconds if self._holders else 0.0  # no rounding left over once all are back
        self._admit()
        self._on_change()

    def _admit(self) -> None:
        """The line's head while it fits, then any short request that fits."""
        while self._line and self._fits(self._line[0].seconds):
            self._let_in(self._line.pop(0))
        for waiter in [w for w in self._line if w.seconds <= self.short_seconds]:
            if self._fits(waiter.seconds):
                self._line.remove(waiter)
                self._let_in(waiter)

    def _let_in(self, waiter: _Waiter) -> None:
        if not waiter.admitted.done():
            self._take(waiter.seconds)
            waiter.admitted.set_result(None)
