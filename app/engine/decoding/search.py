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
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from app.engine.decoding.batch import Row, common_prefix, scored_logits
from app.engine.decoding.selection import greedy_select, perturbed
from app.model.decoder import TextDecoder


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


class Scored:
    """The main model's next-token logits (rules applied) at nodes of a pass's branches, computed when first asked
    for: node (b, d) predicts the token after branch b's hypothesis plus path[:d].

    hidden [P, S, D]: the pass's hidden states; pending[b]: tokens branch b fed before its path (so node (b, d) sits
    at position pending[b] - 1 + d). A beam asks for a handful of nodes per step, not for every drafted one.
    """

    def __init__(
        self,
        decoder: TextDecoder,
        hidden: Tensor,
        rows: Sequence[Row],
        paths: Sequence[Sequence[int]],
        pending: Sequence[int],
    ) -> None:
        self.decoder, self.hidden, self.rows, self.paths, self.pending = decoder, hidden, rows, paths, pending
        self._done: dict[tuple[int, int], Tensor] = {}

    def at(self, nodes: Sequence[tuple[int, int]], offset: int = 0) -> Tensor:
        """Logits [len(nodes), V] of nodes (b, d), b counted from branch `offset`."""
        wanted = [(offset + b, d) for b, d in nodes]
        missing = list(dict.fromkeys(n for n in wanted if n not in self._done))
        if missing:
            index_b = torch.tensor([b for b, _ in missing], device=self.hidden.device)
            index_s = torch.tensor([self.pending[b] - 1 + d for b, d in missing], device=self.hidden.device)
            selected = self.hidden[index_b, index_s].unsqueeze(1)
            logits = scored_logits(
                self.decoder, selected, [self.rows[b] for b, _ in missing], [self.paths[b] for b, _ in missing],
                [d for _, d in missing],
            )[:, 0]  # fmt: skip
            for n, row in zip(missing, logits, strict=True):
                self._done[n] = row
        return torch.stack([self._done[n] for n in wanted])


class Search(Protocol):
    """One request's decoding of one window: its live hypotheses and how they grow."""

    rows: list[Row]  # the live hypotheses
    stats: RowStats
    no_speech_prob: float | None
    last_move: tuple[int, int]  # drafted tokens (steps) accepted and proposed in the last pass

    @property
    def done(self) -> bool: ...

    def branches(self, drafts: Sequence[Sequence[Sequence[int]]]) -> list[Branch]:
        """The branches to score, given per hypothesis the drafted paths after it (any number, maybe none)."""

    def nodes(self, branches: Sequence[Branch]) -> list[tuple[int, int]]:
        """The nodes it will surely read (the loop scores those of all searches together)."""

    def advance(self, scored: Scored, offset: int, branches: Sequence[Branch]) -> list[Continuation]:
        """Grow from the logits at the nodes of its branches (`scored`, its branches from `offset`). Returns the new
        hypotheses (also the new `rows`)."""

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

    def nodes(self, branches: Sequence[Branch]) -> list[tuple[int, int]]:
        return [(0, d) for d in range(len(branches[0].path) + 1)]

    def advance(self, scored: Scored, offset: int, branches: Sequence[Branch]) -> list[Continuation]:
        row, path = self.rows[0], branches[0].path
        n = len(path)
        logits = scored.at(self.nodes(branches), offset)
        scores = logits
        if row.temperature > 0:
            scores = perturbed(scores, row.temperature, row.seed, len(row.tokens))
        choice = greedy_select(scores, path)
        new = [*path[: choice.accepted], choice.next_token]
        chosen = _chosen_logprobs(logits[: len(new)], new)
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
    """A beam hypothesis: where it sits in the scored tree (`base`: the search's hypothesis it grew from at the
    start of this pass, `suffix`: the tokens it took since) and its row."""

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
    last_move: tuple[int, int] = (0, 0)  # steps taken beyond the first and the depth drafted, in the last pass

    @classmethod
    def start(cls, row: Row, options: BeamOptions) -> BeamSearch:
        row.beam = options.beam_size
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

    def nodes(self, branches: Sequence[Branch]) -> list[tuple[int, int]]:
        return [(b, 0) for b, branch in enumerate(branches) if not any(o.hyp == branch.hyp for o in branches[:b])]

    def advance(self, scored: Scored, offset: int, branches: Sequence[Branch]) -> list[Continuation]:
        nodes: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for b, branch in enumerate(branches):
            for d in range(len(branch.path) + 1):
                nodes.setdefault((branch.hyp, tuple(branch.path[:d])), (b, d))
        hyps = [_Hypothesis(j, (), row) for j, row in enumerate(self.rows)]
        steps = 0
        while True:
            hyps = self._step(hyps, scored.at([nodes[(h.base, h.suffix)] for h in hyps], offset))
            steps += 1
            if self.completed or not all((h.base, h.suffix) in nodes for h in hyps):
                break
        depth = max(len(branch.path) for branch in branches)
        self.stats.main_passes += 1
        self.stats.drafted += depth
        self.stats.accepted += steps - 1
        self.last_move = (steps - 1, depth)
        self.rows = [h.row for h in hyps]
        return [self._continuation(h, branches) for h in hyps] if not self.completed else []

    def _continuation(self, h: _Hypothesis, branches: Sequence[Branch]) -> Continuation:
        """The branch of h's base hypothesis that drafted most of h's suffix, and how much of h it holds."""
        best, shared = 0, -1
        for b, branch in enumerate(branches):
            if branch.hyp != h.base:
                continue
            n = common_prefix(branch.path, list(h.suffix))
            if n > shared:
                best, shared = b, n
        base_len = len(h.row.tokens) - len(h.suffix)
        return Continuation(h.row, best, base_len + shared)

    def _step(self, hyps: list[_Hypothesis], logits: Tensor) -> list[_Hypothesis]:
        """One step of openai-whisper's `BeamSearchDecoder.update` for this request; logits [H, V]."""
        step = beam_step(logits, [h.row.sum_logprob for h in hyps], self.options.beam_size, hyps[0].row.eot)
        kept: list[_Hypothesis] = []
        for c in step.kept:
            parent = hyps[c.parent]
            row = parent.row.fork(c.token, c.score, [*parent.row.logprobs, c.logprob])
            kept.append(_Hypothesis(parent.base, (*parent.suffix, c.token), row))
        for c in step.finished:
            if len(self.finished) >= self.options.max_candidates:
                break
            parent_row = hyps[c.parent].row
            self.finished.append(_Finished(parent_row.generated, c.score, parent_row.logprobs, True))
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


def best_of(candidates: list[Decoded], length_penalty: float | None) -> Decoded:
    """The best ranked of a window's samples (openai-whisper's ranker), with the counters of all of them: they
    shared each pass, so passes are counted once."""
    best = candidates[rank([(len(d.tokens), d.sum_logprob) for d in candidates], length_penalty)]
    stats = RowStats(main_passes=max(d.stats.main_passes for d in candidates))
    for d in candidates:
        stats.drafted += d.stats.drafted
        stats.accepted += d.stats.accepted
        stats.draft_passes = max(stats.draft_passes, d.stats.draft_passes)
    return replace(best, stats=stats)


@dataclass(frozen=True)
class Candidate:
    parent: int  # index of the hypothesis it extends
    token: int
    score: float  # the hypothesis's summed log-probability with this token (float32)
    logprob: float  # this token's


@dataclass(frozen=True)
class BeamStep:
    kept: list[Candidate]  # the next hypotheses, best first (at most beam_size)
    finished: list[Candidate]  # ranked above the last kept one and ending in end-of-text, best first


def beam_step(logits: Tensor, sums: Sequence[float], beam_size: int, eot: int) -> BeamStep:
    """Rank every hypothesis's beam_size + 1 likeliest next tokens (logits [H, V], rules applied; sums: the
    hypotheses' summed log-probabilities) by summed log-probability, in float32 as openai-whisper sums them;
    a stable sort keeps ties in its order (hypothesis by hypothesis, each in top-k order). Shared by the main
    model's beam search and a draft's."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(beam_size + 1)
    base = torch.tensor(list(sums), dtype=torch.float32, device=logprobs.device)
    scores = (base.unsqueeze(1) + top.values).tolist()
    tokens, values = top.indices.tolist(), top.values.tolist()
    order = [(j, k) for j in range(len(sums)) for k in range(beam_size + 1)]
    kept: list[Candidate] = []
    finished: list[Candidate] = []
    for j, k in sorted(order, key=lambda c: scores[c[0]][c[1]], reverse=True):
        candidate = Candidate(j, tokens[j][k], scores[j][k], values[j][k])
        if candidate.token == eot:
            finished.append(candidate)
            continue
        kept.append(candidate)
        if len(kept) == beam_size:
            break
    return BeamStep(kept, finished)
