"""Logit rules of Whisper's decoding, shared by the main model, the drafts and every mode.

A rule edits a block of next-token logits in place. In speculative decoding one
block holds many positions of many rows at once (every drafted position is
verified in the same pass), so each logit row comes with the number of tokens
already generated before it (`sample_index`) and the generated tokens themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor


class LogitContext:
    """What the rules may look at for each of N logit rows.

    sample_index: [N] number of tokens generated (prompt excluded) before this position.
    histories: N sequences of those generated tokens (the accepted ones plus drafts before this
    position), built on first use since most rules never look at them.
    """

    def __init__(self, sample_index: Tensor, histories: Callable[[], Sequence[Sequence[int]]]) -> None:
        self.sample_index = sample_index
        self._histories = histories

    @cached_property
    def histories(self) -> Sequence[Sequence[int]]:
        return self._histories()


class LogitRule(Protocol):
    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        """Edit logits [N, V] in place."""


@dataclass(frozen=True)
class SuppressTokens:
    """Never emit these tokens (Whisper's `suppress_tokens`: symbols, speaker tags, special tokens)."""

    token_ids: tuple[int, ...]

    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        logits[:, list(self.token_ids)] = -torch.inf


@dataclass(frozen=True)
class SuppressAtBegin:
    """Suppress tokens at the first generated position (Whisper's `begin_suppress_tokens`)."""

    token_ids: tuple[int, ...]

    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        first = (ctx.sample_index == 0).nonzero().flatten()
        if first.numel():
            ids = torch.tensor(self.token_ids, device=logits.device)
            logits[first.unsqueeze(1), ids.unsqueeze(0)] = -torch.inf


@dataclass(frozen=True)
class LogitRules:
    """The ordered rules for one decoding task."""

    rules: tuple[LogitRule, ...]

    def apply(self, logits: Tensor, ctx: LogitContext) -> Tensor:
        for rule in self.rules:
            rule.apply(logits, ctx)
        return logits
