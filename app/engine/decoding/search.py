"""Search strategies: how a request's hypotheses grow from the main model's verified logits.

A decoding pass scores *branches*: a hypothesis followed by the tokens drafted after it (none without a
drafter), with the main model's logits at every node of it (`Scored`). A strategy turns them into its next
hypotheses, each a `Continuation` saying which branch's cache holds its prefix:

- `Greedy` keeps one hypothesis: the longest prefix of its drafts equal to the main model's own choices plus
  the main model's next token (a sampling row's choices are argmaxes of noise-perturbed logits,
  `app.engine.decoding.selection`);
- `BeamSearch` keeps openai-whisper's beam (`BeamSearchDecoder`): each step ranks every hypothesis's
  beam_size + 1 likeliest tokens by summed log-probability, collects those ending in end-of-text until there
  are round(beam_size * patience), keeps the beam_size best others, and at the end ranks the finished ones
  (`rank`). Over a drafted tree it replays these steps on the logits of the scored nodes for as long as every
  hypothesis it keeps is one of them; the steps are the same whatever was drafted, so is the output.

Without drafts both are plain decoding, one token (one beam step) per pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from app.engine.decoding.batch import Row
from app.engine.decoding.selection import greedy_select, perturbed


@dataclass
class RowStats:
    """Counters of one search over its decoding."""

    drafted: int = 0
    accepted: int = 0
    main_passes: int = 0
    draft_passes: int = 0

    def add(self, other: RowStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.main_passes += other.main_passes
        self.draft_passes += other.draft_passes


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]
    finish: str
    sum_logprob: float
    no_speech_prob: float | None
    stats: RowStats
    logprobs: list[float]  # of each token (from the main model's logits, before any temperature)

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)


@dataclass(frozen=True)
class Branch:
    """A row of a main pass: hypothesis `hyp` of its search followed by the drafted `path`."""

    hyp: int
    path: list[int]


@dataclass(frozen=True)
class Continuation:
    """A hypothesis after a pass, with the search's branch whose cache holds its first `cached` tokens."""

    row: Row
    branch: int
    cached: int


class Search(Protocol):
    """One request's decoding of one window: its live hypotheses and how they grow."""

    rows: list[Row]  # the live hypotheses
    stats: RowStats
    no_speech_prob: float | None

    @property
    def done(self) -> bool: ...

    def branches(self, drafts: Sequence[Sequence[Sequence[int]]]) -> list[Branch]:
        """The branches to score, given per hypothesis the drafted paths after it (any number, maybe none)."""

    def advance(self, logits: Tensor, branches: Sequence[Branch]) -> list[Continuation]:
        """Grow from logits [len(branches), K, V] (rules applied): position d of branch b predicts the token after
        its hypothesis plus path[:d]. Returns the new hypotheses (also the new `rows`)."""

    def result(self) -> Decoded: ...


def _chosen_logprobs(logits: Tensor, tokens: Sequence[int]) -> list[float]:
    """log-softmax of logits [n, V] at tokens[i] for each row i."""
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(list(tokens), device=logprobs.device).unsqueeze(-1)
    return logprobs.gather(-1, index).flatten().tolist()  # type: ignore[no-any-return]


class Greedy:
    """Greedy decoding (or sampling at the row's temperature) of one row, verifying the drafts after it."""

    def __init__(self, row: Row) -> None:
        self.rows = [row]
        self.stats = RowStats()
        self.no_speech_prob: float | None = None
        self.last_move = (0, 0)  # drafts accepted and proposed in the last pass

    @property
    def done(self) -> bool:
        return self.rows[0].finish is not None

    def branches(self, drafts: Sequence[Sequence[Sequence[int]]]) -> list[Branch]:
        paths = drafts[0] if drafts else []
        return [Branch(0, list(paths[0]) if paths else [])]

    def advance(self, logits: Tensor, branches: Sequence[Branch]) -> list[Continuation]:
        row, path = self.rows[0], branches[0].path
        n = len(path)
        scores = logits[0, : n + 1]
        if row.temperature > 0:
            scores = perturbed(scores, row.temperature, row.seed, len(row.tokens))
        choice = greedy_select(scores, path)
        new = [*path[: choice.accepted], choice.next_token]
        chosen = _chosen_logprobs(logits[0, : len(new)], new)
        held = len(row.tokens) + n  # what the branch's cache row holds: the row's tokens and its drafts
        kept = len(row.tokens)
        row.extend(new)
        # Sum the log-probabilities of what was kept, end-of-text included, as OpenAI's decoder does
        # (its average divides by the text's length plus one: the end).
        added = len(row.tokens) - kept
        row.logprobs.extend(chosen[:added])
        row.sum_logprob += float(sum(chosen[: added + (row.finish == "stop")]))
        self.stats.drafted += n
        self.stats.accepted += choice.accepted
        self.stats.main_passes += 1
        self.last_move = (choice.accepted, n)
        return [Continuation(row, 0, held)]

    def result(self) -> Decoded:
        row = self.rows[0]
        finish = row.finish or "stop"
        return Decoded(row.generated, finish, row.sum_logprob, self.no_speech_prob, self.stats, row.logprobs)


@dataclass(frozen=True)
class BeamOptions:
    beam_size: int
    patience: float | None = None
    length_penalty: float | None = None

    @property
    def max_candidates(self) -> int:
        """How many finished hypotheses end the search (openai-whisper: round(beam_size * patience))."""
        return max(1, round(self.beam_size * (self.patience or 1.0)))


@dataclass
class _Hypothesis:
    """A beam hypothesis: where it sits in the scored tree (`branch_of`: its search hypothesis, `suffix`: the
    tokens it took in this pass) and its row."""

    base: int
    suffix: tuple[int, ...]
    row: Row


@dataclass
class _Finished:
    tokens: list[int]  # generated, end-of-text excluded
    score: float
    logprobs: list[float]
    ended: bool  # ended with end-of-text (else cut at the length limit)


@dataclass
class BeamSearch:
    """openai-whisper's beam search for one request's window, starting from one row (its prompt).

    Scores are float32 sums, as the reference keeps them; candidates are ranked by a stable sort, so ties go
    in the order the reference inserts them (hypothesis by hypothesis, each in top-k order).
    """

    options: BeamOptions
    rows: list[Row]
    stats: RowStats = field(default_factory=RowStats)
    no_speech_prob: float | None = None
    finished: list[_Finished] = field(default_factory=list)
    completed: bool = False

    @classmethod
    def start(cls, row: Row, options: BeamOptions) -> BeamSearch:
        return cls(options, [row])

    @property
    def done(self) -> bool:
        return self.completed

    def branches(self, drafts: Sequence[Sequence[Sequence[int]]]) -> list[Branch]:
        out = []
        for j in range(len(self.rows)):
            paths = drafts[j] if j < len(drafts) else []
            out += [Branch(j, list(p)) for p in paths] if paths else [Branch(j, [])]
        return out

    def advance(self, logits: Tensor, branches: Sequence[Branch]) -> list[Continuation]:
        nodes: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for b, branch in enumerate(branches):
            for d in range(len(branch.path) + 1):
                nodes.setdefault((branch.hyp, tuple(branch.path[:d])), (b, d))
        hyps = [_Hypothesis(j, (), row) for j, row in enumerate(self.rows)]
        steps = 0
        while True:
            at = [nodes[(h.base, h.suffix)] for h in hyps]
            step_logits = torch.stack([logits[b, d] for b, d in at])
            hyps = self._step(hyps, step_logits)
            steps += 1
            if self.completed or not all((h.base, h.suffix) in nodes for h in hyps):
                break
        self.stats.main_passes += 1
        self.stats.drafted += max(len(branch.path) for branch in branches)
        self.stats.accepted += steps - 1
        self.rows = [h.row for h in hyps]
        return [self._continuation(h, branches) for h in hyps] if not self.completed else []

    def _continuation(self, h: _Hypothesis, branches: Sequence[Branch]) -> Continuation:
        """The branch of h's base hypothesis that drafted most of h's suffix, and how much of h it holds."""
        best, shared = 0, -1
        for b, branch in enumerate(branches):
            if branch.hyp != h.base:
                continue
            n = 0
            while n < min(len(branch.path), len(h.suffix)) and branch.path[n] == h.suffix[n]:
                n += 1
            if n > shared:
                best, shared = b, n
        base_len = len(h.row.tokens) - len(h.suffix)
        return Continuation(h.row, best, base_len + shared)

    def _step(self, hyps: list[_Hypothesis], logits: Tensor) -> list[_Hypothesis]:
        """One step of openai-whisper's `BeamSearchDecoder.update` for this request; logits [H, V]."""
        beam, eot = self.options.beam_size, hyps[0].row.eot
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(beam + 1)
        sums = torch.tensor([h.row.sum_logprob for h in hyps], dtype=torch.float32, device=logprobs.device)
        scores = (sums.unsqueeze(1) + top.values).tolist()  # float32 sums, as the reference's
        tokens = top.indices.tolist()
        values = top.values.tolist()
        order = [(j, k) for j in range(len(hyps)) for k in range(beam + 1)]
        ranked = sorted(order, key=lambda c: scores[c[0]][c[1]], reverse=True)
        kept: list[_Hypothesis] = []
        newly: list[_Finished] = []
        for j, k in ranked:
            parent, token, score = hyps[j], tokens[j][k], scores[j][k]
            logprob_list = [*parent.row.logprobs, values[j][k]]
            if token == eot:
                newly.append(_Finished(parent.row.generated, score, parent.row.logprobs, True))
                continue
            row = parent.row.fork(token, score, logprob_list)
            kept.append(_Hypothesis(parent.base, (*parent.suffix, token), row))
            if len(kept) == beam:
                break
        for f in newly:
            if len(self.finished) >= self.options.max_candidates:
                break
            self.finished.append(f)
        if len(self.finished) >= self.options.max_candidates or len(kept[0].row.tokens) >= kept[0].row.max_len:
            self._finalize(kept)
        return kept

    def _finalize(self, live: list[_Hypothesis]) -> None:
        """End the search: with fewer than beam_size finished hypotheses (at the length limit, or with patience
        below 1), add the likeliest live ones, as openai-whisper's `finalize` does."""
        sums = np.array([h.row.sum_logprob for h in live], dtype=np.float32)
        for j in list(np.argsort(sums))[::-1]:
            if len(self.finished) >= self.options.beam_size:
                break
            row = live[j].row
            self.finished.append(_Finished(row.generated, row.sum_logprob, row.logprobs, False))
        self.completed = True

    def result(self) -> Decoded:
        best = self.finished[rank([(len(f.tokens), f.score) for f in self.finished], self.options.length_penalty)]
        return Decoded(
            best.tokens,
            "stop" if best.ended else "length",
            best.score,
            self.no_speech_prob,
            self.stats,
            best.logprobs,
        )


def rank(candidates: Sequence[tuple[int, float]], length_penalty: float | None) -> int:
    """Index of the best (length, summed log-probability) candidate: openai-whisper's `MaximumLikelihoodRanker`,
    the sum over the length (`length_penalty` None) or over ((5 + length) / 6) ** length_penalty; the first of
    equals."""

    def score(length: int, logprob: float) -> float:
        penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
        return logprob / max(penalty, 1e-9)

    scores = [score(n, lp) for n, lp in candidates]
    return int(np.argmax(scores))
