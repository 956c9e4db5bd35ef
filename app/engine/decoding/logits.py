"""Logit rules of Whisper's decoding, shared by the main model, the drafts and every mode.

A rule edits a block of next-token logits in place. In speculative decoding one
block holds many positions of many rows at once (every drafted position is
verified in the same pass), so each logit row comes with the number of tokens
already generated before it (`sample_index`) and the generated tokens themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from app.model.whisper import WhisperModel


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
class _TokenSet:
    """A fixed set of token ids with its index tensor built once (rules run at every decoding step)."""

    token_ids: tuple[int, ...]
    _index: Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", torch.tensor(self.token_ids, dtype=torch.long))

    def index(self, device: torch.device) -> Tensor:
        return self._index.to(device)


@dataclass(frozen=True)
class SuppressTokens(_TokenSet):
    """Never emit these tokens (Whisper's `suppress_tokens`: symbols, speaker tags, special tokens)."""

    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        logits.index_fill_(-1, self.index(logits.device), -torch.inf)


@dataclass(frozen=True)
class SuppressAtBegin(_TokenSet):
    """Suppress tokens at the first generated position (Whisper's `begin_suppress_tokens`)."""

    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        first = (ctx.sample_index == 0).nonzero().flatten()
        if first.numel():
            ids = self.index(logits.device)
            logits[first.unsqueeze(1), ids.unsqueeze(0)] = -torch.inf


@dataclass(frozen=True)
class LogitRules:
    """The ordered rules for one decoding task."""

    rules: tuple[LogitRule, ...]

    def apply(self, logits: Tensor, ctx: LogitContext) -> Tensor:
        for rule in self.rules:
            rule.apply(logits, ctx)
        return logits


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp-token rules (OpenAI `ApplyTimestampRules`), per logit row.

    Timestamps come in pairs (except right before end-of-text), never decrease, a segment
    has nonzero length, the first token is a timestamp no later than `max_initial_index`,
    and a timestamp is forced when the timestamps together are likelier than any text token.
    """

    timestamp_begin: int
    eot: int
    no_timestamps: int
    max_initial_index: int | None = 50

    def apply(self, logits: Tensor, ctx: LogitContext) -> None:
        tb = self.timestamp_begin
        logits[:, self.no_timestamps] = -torch.inf
        for n, seq in enumerate(ctx.histories):
            if not seq:
                logits[n, :tb] = -torch.inf
                if self.max_initial_index is not None:
                    logits[n, tb + self.max_initial_index + 1 :] = -torch.inf
                continue
            last_ts = seq[-1] >= tb
            penultimate_ts = len(seq) < 2 or seq[-2] >= tb
            if last_ts:
                if penultimate_ts:
                    logits[n, tb:] = -torch.inf  # a pair just closed: text (or end) must follow
                else:
                    logits[n, : self.eot] = -torch.inf  # an opened segment: timestamp or end-of-text
            timestamps = [t for t in seq if t >= tb]
            if timestamps:
                floor = timestamps[-1] if last_ts and not penultimate_ts else timestamps[-1] + 1
                logits[n, tb:floor] = -torch.inf
        logprobs = torch.log_softmax(logits, dim=-1)
        timestamp_mass = logprobs[:, tb:].logsumexp(dim=-1)
        best_text = logprobs[:, :tb].max(dim=-1).values
        force = (timestamp_mass > best_text).nonzero().flatten()
        if force.numel():
            logits[force, :tb] = -torch.inf


def whisper_rules(model: WhisperModel, timestamps: bool = False) -> LogitRules:
    """Whisper's suppression rules for `model`'s vocabulary (timestamp rules come with timestamp mode)."""
    tok = model.tokenizer
    special = [tok.task_ids["transcribe"], tok.sot, tok.sot_prev, tok.no_speech]
    if "translate" in tok.task_ids:
        special.append(tok.task_ids["translate"])
    sot_lm = tok.backend.token_to_id("<|startoflm|>")
    if sot_lm is not None:
        special.append(int(sot_lm))
    if not timestamps:
        special += [tok.no_timestamps, *range(tok.timestamp_begin, model.decoder.vocab_size)]
    suppress = sorted(set(model.constants.suppress_tokens) | set(special))
    rules: list[LogitRule] = [
        SuppressTokens(tuple(suppress)),
        SuppressAtBegin(tuple(model.constants.begin_suppress_tokens)),
    ]
    if timestamps:
        rules.append(
            TimestampRules(
                tok.timestamp_begin,
                tok.eot,
                tok.no_timestamps,
                model.constants.max_initial_timestamp_index,
            )
        )
    return LogitRules(tuple(rules))
