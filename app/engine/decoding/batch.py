"""Ragged batches of token rows: the padding and indexing shared by the main model and the drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from app.engine.decoding.logits import LogitContext, LogitRules
from app.model.decoder import AttentionCapture, CrossKV, KVCache, TextDecoder


@dataclass(frozen=True)
class RaggedFeed:
    """Rows of different lengths, right-padded into [B, S] tensors.

    tokens, positions: [B, S]; real: [B, S] (False on padding); lengths: the real length of each row.
    Padding repeats the row's last real position so that it attends like a real token.
    """

    tokens: Tensor
    positions: Tensor
    real: Tensor
    lengths: list[int]

    @classmethod
    def build(cls, rows: Sequence[Sequence[int]], starts: Sequence[int], device: torch.device) -> RaggedFeed:
        width = max(1, max(len(r) for r in rows))
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        real = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (row, start) in enumerate(zip(rows, starts, strict=True)):
            n = len(row)
            if n:
                tokens[b, :n] = torch.tensor(row, dtype=torch.long)
                real[b, :n] = True
            positions[b, :n] = torch.arange(start, start + n)
            positions[b, n:] = max(start + n - 1, 0)
        return cls(tokens.to(device), positions.to(device), real.to(device), [len(r) for r in rows])


@dataclass
class DecoderState:
    """One decoder's cache for a batch, and how many tokens of each row it already holds."""

    decoder: TextDecoder
    cache: KVCache
    cross: CrossKV
    fed: list[int]

    @classmethod
    def start(cls, decoder: TextDecoder, cross: CrossKV, batch: int, capacity: int | None = None) -> DecoderState:
        """An empty cache for `batch` rows of at most `capacity` tokens (None: the decoder's limit)."""
        device = cross.keys[0].device
        return cls(decoder, decoder.new_cache(batch, decoder.dtype, device, capacity), cross, [0] * batch)

    def feed(self, rows: Sequence[Sequence[int]], capture: AttentionCapture | None = None) -> tuple[Tensor, RaggedFeed]:
        """Append `rows` after what each row holds; returns hidden states [B, S, D] and the feed.

        `capture` keeps the cross-attention scores of the heads it names, before the softmax (for word alignment).
        """
        feed = RaggedFeed.build(rows, self.fed, self.cross.keys[0].device)
        hidden = self.decoder(feed.tokens, feed.positions, feed.real, self.cache, self.cross, capture)
        self.fed = [f + n for f, n in zip(self.fed, feed.lengths, strict=True)]
        return hidden, feed

    def rewind(self, valid: Sequence[int]) -> None:
        """Forget everything past `valid[b]` tokens of row b (it is overwritten before it is read again)."""
        self.fed = [min(f, v) for f, v in zip(self.fed, valid, strict=True)]

    def regroup(self, rows: Sequence[int], fed: Sequence[int], cross: CrossKV) -> None:
        """Row i becomes a copy of row rows[i] holding its first fed[i] tokens (a row may be copied more than once,
        or dropped); `cross`: the new rows' cross-attention keys/values."""
        if list(rows) != list(range(len(self.fed))):
            index = torch.tensor(list(rows), dtype=torch.long, device=self.cross.keys[0].device)
            self.cache = self.cache.gather(index, max(fed, default=0))
        self.cross = cross
        self.fed = list(fed)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences of one type (lists, or tuples): slices compare
    at C speed."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi - 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def gather_positions(hidden: Tensor, index: Sequence[Sequence[int]]) -> Tensor:
    """hidden [B, S, D], index: per row a list of positions (ragged) -> [B, K, D], K = longest list.

    Short rows are padded by repeating their first index.
    """
    width = max(len(i) for i in index)
    idx = torch.tensor([list(i) + [i[0]] * (width - len(i)) for i in index], dtype=torch.long, device=hidden.device)
    return hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


@dataclass
class Row:
    """One request inside a decoding batch: its tokens so far and its rules and limits."""

    tokens: list[int]
    prompt_len: int
    rules: LogitRules
    max_len: int
    eot: int
    draft: bool = True
    temperature: float = 0.0
    seed: int = 0  # keys the sampling noise of each position (app.engine.decoding.selection)
    sot_index: int = 0
    group: int = 0  # the search it belongs to (its hypotheses share it)
    beam: int = 1  # the beam width of that search (1: greedy or sampling)
    finish: str | None = None
    sum_logprob: float = 0.0
    no_speech_prob: float | None = None
    logprobs: list[float] = field(default_factory=list)  # of each generated token (end-of-text not included)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def room(self) -> int:
        """How many more tokens this row may take."""
        return self.max_len - len(self.tokens)

    @property
    def draft_budget(self) -> int:
        """Most drafts worth proposing: one verification pass adds the drafts plus one token."""
        return max(0, self.room - 1) if self.draft else 0

    def fork(self, token: int, sum_logprob: float, logprobs: list[float]) -> Row:
        """Another hypothesis: this one's tokens and `token`, with its summed and per-token log-probabilities."""
        return replace(self, tokens=[*self.tokens, token], sum_logprob=sum_logprob, logprobs=logprobs, finish=None)

    def extend(self, new: Sequence[int]) -> None:
        """Append accepted tokens, stopping at end-of-text or at the length limit."""
        for token in new:
            if token == self.eot:
                self.finish = "stop"
                return
            self.tokens.append(token)
            if self.room <= 0:
                self.finish = "length"
                return


def scored_logits(
    decoder: TextDecoder,
    hidden: Tensor,
    rows: Sequence[Row],
    extra: Sequence[Sequence[int]],
    start: Sequence[int] | None = None,
) -> Tensor:
    """Next-token logits [B, K, V] of the selected hidden states [B, K, D], with each row's rules applied.

    Position j of row b predicts the token after the row's tokens plus `extra[b][:start[b] + j]`
    (drafted tokens not yet accepted; `start` defaults to 0), so the rules see exactly that history.
    """
    offsets = list(start) if start is not None else [0] * len(rows)
    logits = decoder.logits(hidden)
    b, k, v = logits.shape
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(id(row.rules), []).append(i)
    for members in groups.values():
        rules = rows[members[0]].rules
        sample_index = torch.tensor(
            [len(rows[i].tokens) - rows[i].prompt_len + offsets[i] + j for i in members for j in range(k)],
            device=logits.device,
        )

        def histories(members: list[int] = members) -> list[list[int]]:
            return [rows[i].generated + list(extra[i][: offsets[i] + j]) for i in members for j in range(k)]

        ctx = LogitContext(sample_index, histories)
        if len(members) == b:
            rules.apply(logits.view(b * k, v), ctx)
        else:
            index = torch.tensor(members, device=logits.device)
            block = logits.index_select(0, index).view(len(members) * k, v)
            logits.index_copy_(0, index, rules.apply(block, ctx).view(len(members), k, v))
    return logits
