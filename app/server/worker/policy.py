"""Choosing per batch between speculative and plain batched greedy decoding, from measured costs.

Speculation pays at small batches and stops paying as batches grow (the main model's verify pass
gets as expensive as the work it saves). Rather than a fixed cut-off, the policy measures, per
batch size, what each mode costs for a given amount of content, picks the cheaper one, and now
and then runs the other one so that its estimates follow changes in content, acceptance and
machine load. Both modes give the same tokens (greedy), so the choice only moves time.

The unit of content is the plain pass: how many batched main forward passes plain decoding needs
for a batch (its longest row's tokens plus one end-of-text per window). Both modes yield the same
tokens, so this is known after a batch in either mode. Plain decoding costs nearly the same per
pass whatever the clip, so its estimate settles after one batch; a speculative batch's cost per
plain pass is its speed relative to plain decoding on that very content. Seconds per generated
token, the obvious measure, mixes in how short the clips were (a short clip spends a larger share
of its passes on the prompt and end-of-text), so a few short clips could decide the verdict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

Mode = Literal["speculative", "plain"]
Speculation = Literal["adaptive", "always", "never"]
SPECULATION_MODES: tuple[str, ...] = ("adaptive", "always", "never")
MODES: tuple[Mode, Mode] = ("speculative", "plain")
# Batches from which an estimate is their median; until then a verdict no other size backs is re-checked soon.
MEDIAN_FROM = 3


@dataclass(frozen=True)
class BatchCost:
    """One finished batch: its decoding seconds and its content in plain passes (see the module doc)."""

    seconds: float
    plain_passes: int

    @classmethod
    def of(cls, seconds: float, rows: list[tuple[int, int]]) -> BatchCost:
        """From each row's (tokens generated, windows decoded); its rows run in lockstep."""
        return cls(seconds, max((tokens + windows for tokens, windows in rows), default=0))


@dataclass(frozen=True)
class Estimate:
    """The policy's current cost estimate of one mode at one batch size (for logs and metrics)."""

    mode: Mode
    batch: int
    ms_per_plain_pass: float
    samples: int


@dataclass
class _Rate:
    """Seconds per plain pass of one mode at one batch size, from its last `window` batches.

    From MEDIAN_FROM batches on, the median of their rates (weighted by their plain passes), so that a
    batch slowed by something else on the machine does not move the estimate; before that, the
    rate of their sums. Unless `warm`, the first batch is set aside: the first batch of a mode at a
    batch size pays one-off costs (wider caches, new shapes), which made it read up to three times
    slower than the next ones. `warm`: those costs were paid before the first request (the worker's
    warm-up).
    """

    window: int
    warm: bool = False
    recent: deque[BatchCost] = field(default_factory=deque)
    seen: int = 0  # batches observed, a set-aside first one included

    @property
    def samples(self) -> int:
        """Batches in the estimate."""
        return len(self.recent)

    def restart(self) -> None:
        """Forget the batches in the estimate (the next one starts it afresh)."""
        self.recent.clear()

    def add(self, cost: BatchCost) -> None:
        self.seen += 1
        if self.seen == 1 and not self.warm:
            return
        self.recent.append(cost)
        if len(self.recent) > self.window:
            self.recent.popleft()

    @property
    def value(self) -> float:
        if not self.recent:
            return 0.0
        if len(self.recent) < MEDIAN_FROM:
            return sum(c.seconds for c in self.recent) / sum(c.plain_passes for c in self.recent)
        rates = sorted((c.seconds / c.plain_passes, c.plain_passes) for c in self.recent)
        cumulative = list(accumulate(passes for _, passes in rates))
        return next(rate for (rate, _), upto in zip(rates, cumulative, strict=True) if upto >= cumulative[-1] / 2)


@dataclass
class ModePolicy:
    """Per-batch-size cost estimates of both modes, and the choice they imply.

    warmup: batches of each mode measured at a batch size (after a set-aside first one) before its
        estimates are trusted. A batch size seen for the first time borrows the verdict of the
        nearest trusted size, then measures both modes.
    explore_every: once trusted, one batch in n at a size runs the mode that lost (one in 4n when it
        lost by more than `clear_margin`), so the estimates follow content and load. A verdict that no
        other batch size backs (the nearest trusted size, if any, found the other mode cheaper) is
        re-checked sooner while the loser's estimate rests on fewer than MEDIAN_FROM batches: the loser
        runs again 2 and then 4 batches after its last one. A single batch that read slow (the
        machine busy with something else) would otherwise hand the verdict to the other mode for
        4n batches.
    window: the batches per mode and size that its estimate is taken from (the latest ones).
    warmed: batch sizes at which both modes already ran before the first request (the worker warms
        up at one row and at its largest batch), so that their first batches need not be set aside.
    """

    speculation: Speculation = "adaptive"
    warmup: int = 1
    explore_every: int = 10
    clear_margin: float = 1.25
    window: int = 8
    warmed: frozenset[int] = frozenset()
    _rates: dict[tuple[Mode, int], _Rate] = field(default_factory=dict)
    _batches: dict[int, int] = field(default_factory=dict)
    _last_run: dict[tuple[Mode, int], int] = field(default_factory=dict)  # batch index it last ran at

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, not {self.speculation!r}")
        if (
            self.warmup < 1
            or self.explore_every < 2
            or self.window < max(self.warmup, MEDIAN_FROM)
            or self.clear_margin < 1
        ):
            raise ValueError(
                f"need warmup >= 1, explore_every >= 2, window >= warmup and >= {MEDIAN_FROM}, and clear_margin >= 1"
            )

    def rate(self, mode: Mode, batch: int) -> _Rate:
        return self._rates.setdefault((mode, batch), _Rate(self.window, warm=batch in self.warmed))

    def _trusted(self, batch: int) -> bool:
        return all(self.rate(mode, batch).samples >= self.warmup for mode in MODES)

    def _verdict(self, batch: int) -> tuple[Mode, float]:
        """The cheaper mode at `batch` and how many times cheaper it is."""
        spec, plain = self.rate("speculative", batch).value, self.rate("plain", batch).value
        if spec <= plain:
            return "speculative", plain / max(spec, 1e-12)
        return "plain", spec / max(plain, 1e-12)

    def choose(self, batch: int) -> Mode:
        """The mode for the next batch of `batch` speculative-eligible requests."""
        if self.speculation == "always":
            return "speculative"
        if self.speculation == "never":
            return "plain"
        n = self._batches.get(batch, 0)
        self._batches[batch] = n + 1
        mode = self._pick(batch, n)
        self._last_run[mode, batch] = n
        return mode

    def _pick(self, batch: int, n: int) -> Mode:
        """The mode for the n-th batch (from 0) at `batch` rows."""
        if not self._trusted(batch):
            counts = {mode: self.rate(mode, batch).seen for mode in MODES}
            borrowed = self._nearest_verdict(batch)
            if borrowed is not None and not any(counts.values()):
                return borrowed
            return min(MODES, key=lambda mode: counts[mode])  # ties: speculative first
        best, margin = self._verdict(batch)
        loser: Mode = "plain" if best == "speculative" else "speculative"
        period = self.explore_every * (4 if margin > self.clear_margin else 1)
        young = self.rate(loser, batch).samples
        if young < MEDIAN_FROM and self._nearest_verdict(batch) in (None, loser):
            period = min(period, 2**young)
        return loser if n - self._last_run.get((loser, batch), -1) >= period else best

    def _nearest_verdict(self, batch: int) -> Mode | None:
        """The cheaper mode at the nearest other trusted batch size (None: there is none)."""
        known = sorted((abs(b - batch), b) for (_, b) in self._rates if b != batch and self._trusted(b))
        return self._verdict(known[0][1])[0] if known else None

    def observe(self, mode: Mode, batch: int, cost: BatchCost) -> None:
        """Record a finished batch of `batch` rows decoded in `mode`.

        A batch of the losing mode that comes out cheaper than the winner's estimate starts the loser's estimate
        afresh from it: its older batches were measured under other conditions (a burst of load that made it
        lose), and it runs too rarely (one batch in 10 or 40) for its median to follow. Under a storm of uploads,
        speculation's window filled with batches slowed up to 10x while the web process read 20 files at once; plain
        decoding then won for the next ~200 batches although it cost 1.5x more by then. A fluke costs little: the
        new winner runs every batch, so its estimate soon shows its cost."""
        if cost.seconds <= 0 or cost.plain_passes <= 0:
            return
        rate = self.rate(mode, batch)
        if self._trusted(batch):
            best, _ = self._verdict(batch)
            if mode != best and cost.seconds / cost.plain_passes < self.rate(best, batch).value:
                rate.restart()
        rate.add(cost)

    def estimates(self) -> list[Estimate]:
        """Current estimates, by batch size then mode (samples 0: looked up but not measured yet)."""
        return [
            Estimate(mode, batch, r.value * 1000, r.samples)
            for (mode, batch), r in sorted(self._rates.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Current estimates for logs, e.g. {"speculative@1": {"ms_per_plain_pass": .., "samples": ..}, ...}."""
        return {
            f"{e.mode}@{e.batch}": {"ms_per_plain_pass": round(e.ms_per_plain_pass, 3), "samples": e.samples}
            for e in self.estimates()
        }
