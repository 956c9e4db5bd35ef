"""The worker's memory budget, as arithmetic (`MemoryPlan`), and a process's memory as Linux reports it."""

from __future__ import annotations

import mmap
import os

import pytest

from app.server.memory import ProcessMemory, reset_peak
from app.server.worker.budget import CLIP_MARGIN, MemoryBudgetError, MemoryPlan


def test_a_plan_holds_batches_to_what_fits() -> None:
    """A clip is taken to cost its measured cost and a 20% margin (`CLIP_MARGIN`): 120 MB here."""
    assert CLIP_MARGIN == 1.2
    assert MemoryPlan.within(1000, 700, 100, most=4).batch == 2  # 700 + 2 x 120 = 940 <= 1000 < 1060
    assert MemoryPlan.within(1060, 700, 100, most=4).batch == 3
    assert MemoryPlan.within(5000, 700, 100, most=4).batch == 4  # never past max_batch
    assert MemoryPlan.within(820, 700, 100, most=4).batch == 1
    with pytest.raises(MemoryBudgetError, match=r"SPECWHISPER_WORKER_MEMORY_MB=819 is less than .* 700 MB .* 120 MB"):
        MemoryPlan.within(819, 700, 100, most=4)


def test_a_batch_over_the_budget_lowers_the_cap_for_good() -> None:
    plan = MemoryPlan.within(1000, 700, 100, most=4)
    assert plan.after_batch(2, 990) is plan  # within
    lowered = plan.after_batch(2, 1010)
    assert lowered.batch == 1
    assert lowered.after_batch(1, 1200).batch == 1  # one clip a batch is the least there is
    assert plan.after_batch(1, 1010) is plan  # a batch of one over the budget: nothing smaller to go to


def test_process_memory_follows_what_the_process_touches() -> None:
    here = ProcessMemory.of()
    assert here is not None and 0 < here.rss <= here.peak
    assert ProcessMemory.of(os.getpid()) is not None
    assert ProcessMemory.of(2**22 + 12345) is None  # no such process (pid_max is at most 2**22)
    if not reset_peak():
        pytest.skip("this kernel cannot reset a process's peak")
    before = ProcessMemory.of()
    assert before is not None and before.peak - before.rss < 4 << 20  # the peak starts afresh from the RSS
    # A fresh mapping, not the allocator's: a big process (the whole suite's) may have freed heap that is still
    # resident, and a 64-MB array could land there without the RSS moving.
    block = mmap.mmap(-1, 64 << 20)
    for _ in range(64):
        block.write(b"\1" * (1 << 20))  # 64 MB, touched
    during = ProcessMemory.of()
    block.close()
    after = ProcessMemory.of()
    assert during is not None and after is not None
    assert during.rss - before.rss >= 60 << 20
    assert after.peak >= during.rss - (1 << 20)  # Linux counts the peak in batches of pages
    assert after.rss < during.rss - (60 << 20)
