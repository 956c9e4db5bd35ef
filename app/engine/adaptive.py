"""Choosing per batch between speculative and plain batched greedy decoding, from measured costs.

Speculation pays at small batches and stops paying as batches grow (the main model's verify pass
gets as expensive as the work it saves). Rather than a fixed cut-off, the policy measures: for
every batch size it keeps a running (exponentially weighted) decode cost per generated token of
each mode, picks the cheaper one, and now and then runs the other one so that its estimate
follows changes in content, acceptance and machine load. Both modes give the same tokens
(greedy), so the choice only moves time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["speculative", "plain"]
Speculation = Literal["adaptive", "always", "never"]
SPECULATION_MODES: tuple[str, ...] = ("adaptive", "always", "never")


@dataclass
class _Estimate:
    cost: float = 0.0  # seconds of decoding per generated token (EWMA)
    samples: int = 0

    def add(self, value: float, weight: float) -> None:
        self.cost = value if self.samples == 0 else (1 - weight) * self.cost + weight * value
        self.samples += 1


@dataclass
class ModePolicy:
    """Per-batch-size cost estimates of both modes, and the choice they imply.

    warmup: batches of each mode measured at a batch size before its estimates are trusted. A batch
        size seen for the first time borrows the verdict of the nearest measured size, then measures
        the mode it did not run, so learning a new size costs at most one batch in the slower mode.
    explore_every: once trusted, every n-th batch at a size runs the mode that lost (every 4n-th when
        it lost by more than `clear_margin`), so the estimates follow content and load.
    weight: EWMA weight of a new measurement.
    """

    speculation: Speculation = "adaptive"
    warmup: int = 1
    explore_every: int = 10
    clear_margin: float = 1.25
    weight: float = 0.3
    _estimates: dict[tuple[Mode, int], _Estimate] = field(default_factory=dict)
    _batches: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, not {self.speculation!r}")
        if self.warmup < 1 or self.explore_every < 2 or not 0 < self.weight <= 1 or self.clear_margin < 1:
            raise ValueError("need warmup >= 1, explore_every >= 2, 0 < weight <= 1 and clear_margin >= 1")

    def estimate(self, mode: Mode, batch: int) -> _Estimate:
        return self._estimates.setdefault((mode, batch), _Estimate())

    def _trusted(self, batch: int) -> bool:
        return min(self.estimate("speculative", batch).samples, self.estimate("plain", batch).samples) >= self.warmup

    def _verdict(self, batch: int) -> tuple[Mode, float]:
        """The cheaper mode at `batch` and how many times cheaper it is."""
        spec, plain = self.estimate("speculative", batch).cost, self.estimate("plain", batch).cost
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
        spec, plain = self.estimate("speculative", batch), self.estimate("plain", batch)
        if not self._trusted(batch):
            if spec.samples or plain.samples:  # measure the mode not yet run at this size
                return "speculative" if spec.samples < self.warmup else "plain"
            known = sorted((abs(b - batch), b) for (_, b) in self._estimates if b != batch and self._trusted(b))
            return self._verdict(known[0][1])[0] if known else "speculative"
        best, margin = self._verdict(batch)
        period = self.explore_every * (4 if margin > self.clear_margin else 1)
        if n % period == period - 1:
            return "plain" if best == "speculative" else "speculative"
        return best

    def observe(self, mode: Mode, batch: int, decode_seconds: float, tokens: int) -> None:
        """Record a finished batch: its decoding time and the tokens it generated."""
        if tokens > 0 and decode_seconds > 0:
            self.estimate(mode, batch).add(decode_seconds / tokens, self.weight)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Current estimates, e.g. for logs: {"speculative@1": {"ms_per_token": .., "samples": ..}, ...}."""
        return {
            f"{mode}@{batch}": {"ms_per_token": round(e.cost * 1000, 3), "samples": e.samples}
            for (mode, batch), e in sorted(self._estimates.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        }
