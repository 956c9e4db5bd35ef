"""The worker's memory budget (`SPECWHISPER_WORKER_MEMORY_MB`): how many clips a batch may hold so that the worker
stays within it.

What a batch costs is measured here, not assumed: it follows the model, its precision and the machine's threads.
Each clip of a batch holds its cross-attention keys and values (37 MB for Whisper base), its encoder states and its
decoding buffers; the clips are encoded in turn, so the encoder's transient buffers are paid once. During its
warm-up the worker decodes a batch of one (a second of a tone) twice: the first pays the one-off costs (thread
pools, kernel set-up, caches), which stay and so count as the worker's idle size; then it measures its resident
set (heap trimmed) and its peak over the second. The difference is what a clip is taken to cost, with a margin
(`CLIP_MARGIN`): clips of speech cost more than the tone's, as the decoder's buffers grow with the tokens.
Measured on Whisper base with its draft, 2 cores, `python -m app serve`: the tone 119-152 MB a clip from one worker
to the next (steady within one; the first batch of one measured 170-186 MB), speech ~144 MB a clip (a batch of 4
LJSpeech clips peaked 1127-1132 MB, 553 MB idle: docs/deployment.md, "Memory"). After
the warm-up the worker trims its heap again, and the budget's cap is the largest batch whose estimate fits:
`idle + clips * clip_mb * CLIP_MARGIN <= budget`.

An estimate can still fall short of a batch the allocator lays out worse, so each batch's own peak comes back with
its result (`BatchResult.peak_mb`): a batch of n clips that went over lowers the cap to n - 1 for the rest of the
worker's life.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from app.server.memory import ProcessMemory, reset_peak

log = logging.getLogger("specwhisper.worker")

CLIP_MARGIN = 1.2  # what a clip of speech may cost over the warm-up's tone (the module doc)


class MemoryBudgetError(ValueError):
    """The budget cannot hold the worker decoding a batch of one clip: no setting but a larger budget helps."""


class _Warmable(Protocol):
    def warm_up(self, batch_sizes: set[int], *, check: bool = True) -> frozenset[int]: ...


@dataclass(frozen=True)
class MemoryPlan:
    """A worker's budget and what it measured: its resident set once warm and idle, a clip's cost, and the clips a
    batch may hold (`batch`, at least 1)."""

    budget_mb: float
    idle_mb: float
    clip_mb: float
    batch: int

    @classmethod
    def within(cls, budget_mb: float, idle_mb: float, clip_mb: float, most: int) -> MemoryPlan:
        """The largest batch up to `most` whose estimate fits; MemoryBudgetError where not even one clip does."""
        fits = math.floor(round((budget_mb - idle_mb) / (clip_mb * CLIP_MARGIN), 6)) if clip_mb > 0 else most
        if fits < 1:
            raise MemoryBudgetError(
                f"SPECWHISPER_WORKER_MEMORY_MB={budget_mb:g} is less than the worker needs to decode one clip:"
                f" {idle_mb:.0f} MB loaded and warm, and {clip_mb * CLIP_MARGIN:.0f} MB more for a batch of one"
                " (measured in its warm-up, with a margin); raise it, or leave it unset"
            )
        return cls(budget_mb, idle_mb, clip_mb, min(most, fits))

    def after_batch(self, clips: int, peak_mb: float) -> MemoryPlan:
        """The plan once a batch of `clips` peaked at `peak_mb`: a batch that went over the budget is one clip too
        many from now on (never below one)."""
        if peak_mb <= self.budget_mb or clips <= 1 or clips > self.batch:
            return self
        log.warning(
            "a batch of %d clips took the worker to %.0f MB, over its %.0f-MB budget: batches hold at most %d from now",
            clips,
            peak_mb,
            self.budget_mb,
            clips - 1,
        )
        return replace(self, batch=clips - 1)


def warm_up_within(
    engine: _Warmable, budget_mb: float, most: int, trim: Callable[[], None] | None
) -> tuple[frozenset[int], MemoryPlan]:
    """Warm `engine` up at a batch of one, measuring a clip's cost, then at the largest batch the budget holds.

    Returns the batch sizes warmed and the plan; MemoryBudgetError where not even one clip fits, or where the peak
    cannot be measured (no `/proc`)."""
    # The first pays the one-off costs (thread pools, kernel set-up, caches): they stay, and count as idle. It leaves
    # the decoder's batch-invariance check to the measured one, whose peak it is part of: without it a tone's clip
    # measured ~100 MB, well under the ~144 MB of a clip of speech, which the margin was set against.
    engine.warm_up({1}, check=False)
    if trim is not None:
        trim()
    loaded = ProcessMemory.of()
    measured = reset_peak()
    engine.warm_up({1})
    one = ProcessMemory.of()
    if trim is not None:
        trim()
    idle = ProcessMemory.of()
    if loaded is None or one is None or idle is None or not measured:
        raise MemoryBudgetError(
            "SPECWHISPER_WORKER_MEMORY_MB needs the worker's memory measured, from Linux's /proc, which is not here"
        )
    plan = MemoryPlan.within(budget_mb, idle.rss_mb, one.peak_mb - loaded.rss_mb, most)
    if plan.batch > 1:
        engine.warm_up({plan.batch})
    log.info(
        "memory budget %.0f MB: %.0f MB warm and idle, %.0f MB a clip: batches of at most %d",
        plan.budget_mb,
        plan.idle_mb,
        plan.clip_mb,
        plan.batch,
    )
    return frozenset({1, plan.batch}), plan
