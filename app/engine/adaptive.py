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

    warmup: batches of each mode measured at a batch size before the estimates are trusted.
    explore_every: once trusted, every n-th batch at that size runs the mode that lost.
    weight: EWMA weight of a new measurement.
    """

    speculation: Speculation = "adaptive"
    warmup: int = 2
    explore_every: int = 10
    weight: float = 0.3
    _estimates: dict[tuple[Mode, int], _Estimate] = field(default_factory=dict)
    _batches: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, not {self.speculation!r}")
        if self.warmup < 1 or self.explore_every < 2 or not 0 < self.weight <= 1:
            raise ValueError("need warmup >= 1, explore_every >= 2 and 0 < weight <= 1")

    def estimate(self, mode: Mode, batch: int) -> _Estimate:
        return self._estimates.setdefault((mode, batch), _Estimate())

    def choose(self, batch: int) -> Mode:
        """The mode for the next batch of `batch` speculative-eligible requests."""
        if self.speculation == "always":
            return "speculative"
        if self.speculation == "never":
            return "plain"
        n = self._batches.get(batch, 0)
        self._batches[batch] = n + 1
        spec, plain = self.estimate("speculative", batch), self.estimate("plain", batch)
        if spec.samples < self.warmup or plain.samples < self.warmup:
            # Measure both: the less measured mode goes next, speculation first.
            return "speculative" if spec.samples <= plain.samples else "plain"
        best: Mode = "speculative" if spec.cost <= plain.cost else "plain"
        if n % self.explore_every == self.explore_every - 1:
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
