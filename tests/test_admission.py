"""What an upload may cost the web process (app/server/serving/admission.py): the upload threads, shared by the
time each request has used, and the budget of audio in flight, with its line and its refusals."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from app.server.serving.admission import (
    BACKGROUND_NICE,
    PROMPT_S,
    QUANTUM_S,
    Account,
    AudioBudget,
    FairShare,
    OverBudget,
)


def _work(seconds: float) -> None:
    """Use `seconds` of the calling thread's CPU time (a request's steps are counted in CPU time, not wall time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_fresher_request_s_step_goes_before_long_ones_next_steps() -> None:
    """One thread of a tier (all three requests past `PROMPT_S`), two long uploads taking turns, 20-ms steps: an
    upload that arrives mid-way, having used less, runs its step as soon as the running step ends, before the step
    of the long upload waiting in line; steps never overlap."""

    async def main() -> tuple[list[str], int]:
        share, order = FairShare(1), []
        running = threading.Lock()

        def step(name: str) -> None:
            assert running.acquire(blocking=False), "two steps ran at once on one thread"
            _work(0.02)
            order.append(name)
            running.release()

        async def upload(name: str, steps: int) -> None:
            account = Account(used=PROMPT_S)
            for _ in range(steps):
                await share.run(account, lambda: step(name))

        longs = [asyncio.create_task(upload(name, 8)) for name in ("a", "b")]
        while len(order) < 3:  # each long one has used some time
            await asyncio.sleep(0.005)
        arrived = len(order)
        await upload("short", 1)
        await asyncio.gather(*longs)
        share.close()
        return order, arrived

    order, arrived = asyncio.run(main())
    assert order.index("short") <= arrived + 1, order  # at most the step running when it came goes first
    assert order.count("a") == order.count("b") == 8
    assert "a" in order[:4] and "b" in order[:4]  # the two long ones take turns


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities")
def test_a_request_s_first_steps_run_at_once_at_the_process_s_priority() -> None:
    """A long upload's 0.5-s step holds the thread of the tier below (`BACKGROUND_NICE`): a fresh request's first step
    runs at once, on a thread at the process's priority; once it has used `PROMPT_S`, its next step runs below it,
    after the long one's."""

    async def main() -> tuple[int, float, int, bool]:
        share = FairShare(1)
        long = Account(used=PROMPT_S)
        busy = asyncio.create_task(share.run(long, lambda: time.sleep(0.5)))
        await asyncio.sleep(0.05)
        fresh = share.account()
        started = time.perf_counter()
        first = await share.run(fresh, _nice)
        waited = time.perf_counter() - started
        await share.run(fresh, lambda: _work(PROMPT_S))
        later = await share.run(fresh, _nice)
        after_long = busy.done()
        share.close()
        return first, waited, later, after_long

    first, waited, later, after_long = asyncio.run(main())
    assert first == _nice() and waited < 0.3, (first, waited)
    assert later == min(_nice() + BACKGROUND_NICE, 19) and after_long


def test_past_their_first_second_long_uploads_run_one_after_another() -> None:
    """Two uploads that have used their first second of thread time, one thread: the one that gets the long place
    runs all its steps before the other runs any (one finishes early, holding its decoders, instead of both
    finishing last); a fresh upload still goes between two of its steps; a leaving upload hands the place on."""

    async def main() -> list[str]:
        share, order = FairShare(1), []

        async def upload(name: str, account: Account, steps: int) -> None:
            try:
                for _ in range(steps):
                    await share.run(account, lambda: (time.sleep(0.01), order.append(name)))
            finally:
                share.leave(account)

        first, second = share.account(), share.account()
        first.used = second.used = 2.0
        tasks = [asyncio.create_task(upload("first", first, 4)), asyncio.create_task(upload("second", second, 4))]
        await asyncio.sleep(0.015)
        await upload("fresh", share.account(), 1)
        await asyncio.gather(*tasks)
        share.close()
        return order

    order = asyncio.run(main())
    assert order.index("fresh") <= 2, order
    assert [name for name in order if name != "fresh"] == ["first"] * 4 + ["second"] * 4, order


def test_a_request_s_time_is_its_cpu_time_not_the_time_its_steps_waited() -> None:
    """Steps slowed by something else (here: asleep, using no CPU) for longer than the first second in all keep a
    request on the first thread: it does not wait for the long place, which a long upload holds meanwhile (for
    4 s). Steps that compute are counted in full."""

    async def main() -> tuple[Account, Account, float]:
        share = FairShare(1)
        holder, slowed, working = share.account(), share.account(), share.account()
        holder.used = 2.0
        await share.run(holder, lambda: None)  # takes the one long place, and keeps it until it leaves
        asyncio.get_running_loop().call_later(4 * QUANTUM_S, share.leave, holder)
        started = time.perf_counter()
        for _ in range(3):
            await share.run(slowed, lambda: time.sleep(QUANTUM_S / 2))
        took = time.perf_counter() - started
        await share.run(working, lambda: _work(0.1))
        share.close()
        return slowed, working, took

    slowed, working, took = asyncio.run(main())
    assert took < 2.5 * QUANTUM_S, f"waited for the long place: {took:.1f} s"
    assert slowed.used < 0.1 * QUANTUM_S
    assert working.used >= 0.1


def test_a_cancelled_step_keeps_its_thread_until_it_ends() -> None:
    """A request that goes away mid-step: its step finishes on the thread, and only then does the next one start."""

    async def main() -> tuple[float, float]:
        share = FairShare(1)
        ended: list[float] = []

        def slow() -> None:
            time.sleep(0.2)
            ended.append(time.perf_counter())

        first = asyncio.create_task(share.run(Account(), slow))
        await asyncio.sleep(0.02)
        first.cancel()
        started: list[float] = []
        await share.run(Account(), lambda: started.append(time.perf_counter()))
        share.close()
        return ended[0], started[0]

    ended, started = asyncio.run(main())
    assert started >= ended


def test_the_audio_budget_admits_waits_and_refuses() -> None:
    """A budget of 100 s: 60 and 30 run at once; 50 and 40 wait (a line of 90 s); 20 more would make the line
    longer than the budget: 429 with the Retry-After given. A short 5-s upload passes the line (it fits). When the
    first ends, the line is admitted in order, each when it fits."""

    async def main() -> list[str]:
        budget, events = AudioBudget(100, short_seconds=5), []

        async def upload(name: str, seconds: float, hold: asyncio.Event) -> None:
            async with budget.hold(seconds, lambda: 7):
                events.append(f"in {name}")
                await hold.wait()
            events.append(f"out {name}")

        gates = {name: asyncio.Event() for name in ("a", "b", "c", "d", "short")}
        tasks = [asyncio.create_task(upload("a", 60, gates["a"])), asyncio.create_task(upload("b", 30, gates["b"]))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(upload("c", 50, gates["c"])))
        tasks.append(asyncio.create_task(upload("d", 40, gates["d"])))
        await asyncio.sleep(0)
        assert budget.held == 90 and budget.waiting == 2
        with pytest.raises(OverBudget) as refused:
            async with budget.hold(20, lambda: 7):
                pass
        assert refused.value.retry_after == 7
        tasks.append(asyncio.create_task(upload("short", 5, gates["short"])))
        await asyncio.sleep(0)
        assert "in short" in events and budget.held == 95
        gates["short"].set()
        gates["a"].set()
        await asyncio.sleep(0.01)
        assert "in c" in events and "in d" not in events  # 30 + 50 held; d (40) waits for room
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks)
        assert budget.held == 0 and budget.waiting == 0
        return events

    events = asyncio.run(main())
    assert events.index("in c") < events.index("in d")


def test_an_upload_that_leaves_the_line_frees_its_place() -> None:
    async def main() -> tuple[float, int]:
        budget = AudioBudget(10, short_seconds=1)
        release = asyncio.Event()

        async def holder() -> None:
            async with budget.hold(10, lambda: 1):
                await release.wait()

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(holder())
        await asyncio.sleep(0)
        assert budget.waiting == 1
        waiting.cancel()
        await asyncio.sleep(0)
        release.set()
        await first
        return budget.held, budget.waiting

    assert asyncio.run(main()) == (0, 0)


def test_short_uploads_have_a_reserve_long_ones_cannot_fill() -> None:
    """A budget of 100 s full of long uploads, and a line: a 5-s upload still gets in (a reserve of 10 s is its
    own), two more fill the reserve; the next short one waits, and is let in past the long one before it in line
    as soon as a short one leaves."""

    async def main() -> list[str]:
        budget, events = AudioBudget(100, short_seconds=5, reserve=10), []

        async def upload(name: str, seconds: float, hold: asyncio.Event) -> None:
            async with budget.hold(seconds, lambda: 7):
                events.append(f"in {name}")
                await hold.wait()

        gates = {name: asyncio.Event() for name in ("long", "line", "s1", "s2", "s3")}
        tasks = [asyncio.create_task(upload("long", 100, gates["long"]))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(upload("line", 50, gates["line"])))
        await asyncio.sleep(0)
        for name in ("s1", "s2", "s3"):
            tasks.append(asyncio.create_task(upload(name, 5, gates[name])))
            await asyncio.sleep(0)
        assert events == ["in long", "in s1", "in s2"] and budget.held == 110 and budget.waiting == 2
        gates["s1"].set()
        await asyncio.sleep(0.01)
        assert events[-1] == "in s3" and "in line" not in events
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks)
        assert budget.held == 0
        return events

    assert asyncio.run(main())[-1] == "in line"
