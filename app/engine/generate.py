"""The decoding loop: greedy decoding or sampling, with or without drafts, for a batch of rows.

Each iteration a drafter (if any) proposes up to k tokens per row; the main model
feeds, per row, the tokens it has not seen yet followed by the drafts, in one
forward pass, and scores the next token at every drafted position. A row keeps the
longest prefix of drafts equal to the main model's own choices plus the main model's
next token; a sampling row chooses by the argmax of its logits perturbed with noise
keyed by position (`app.engine.decoding.selection`). Without a drafter k is 0 and the
same loop is plain decoding, one token per pass: both modes share every rule and
every op, which is what makes their outputs identical, sampled ones included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from app.engine.decoding.batch import DecoderState, Row, gather_positions, scored_logits
from app.engine.decoding.selection import greedy_select, perturbed
from app.engine.drafting.base import Drafts, DraftSession, PromptAdopting
from app.model.decoder import CrossKV
from app.model.whisper import WhisperModel


@dataclass
class RowStats:
    """Counters of one row over its decoding."""

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
    logprobs: list[float]  # of each token (the main model's, at the temperature it decoded at)

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)


def _no_speech(main: WhisperModel, hidden: torch.Tensor, rows: list[Row]) -> None:
    """Probability of <|nospeech|> at each row's start-of-transcript position (first pass only)."""
    at_sot = gather_positions(hidden, [[row.sot_index] for row in rows])[:, 0]
    probs = main.decoder.logits(at_sot).softmax(-1)[:, main.tokenizer.no_speech].tolist()
    for row, p in zip(rows, probs, strict=True):
        row.no_speech_prob = p


@torch.inference_mode()
def decode(
    main: WhisperModel,
    cross: CrossKV,
    rows: list[Row],
    draft: DraftSession | None,
    tick: Callable[[], None] | None = None,
) -> list[Decoded]:
    """Decode all rows to end-of-text or their length limit; rows leave the batch as they finish.

    tick() is called after each main-model pass (a caller's sign of life; it must be cheap)."""
    state = DecoderState.start(main.decoder, cross, len(rows), capacity=max(row.max_len for row in rows))
    stats = [RowStats() for _ in rows]
    active = list(range(len(rows)))
    first = True
    # A draft that takes the main model's cache of a long prompt waits for the first pass to fill it.
    adopt = isinstance(draft, PromptAdopting) and draft.adopts_prompt(rows)
    while active:
        live = [rows[i] for i in active]
        drafts = Drafts.empty(len(live))
        draft_passes = 0
        if draft is not None and not (first and adopt):
            before = draft.passes
            drafts = draft.get_candidates(live, [row.draft_budget for row in live])
            draft_passes = draft.passes - before
        pending = [row.tokens[fed:] for row, fed in zip(live, state.fed, strict=True)]
        hidden, _ = state.feed([p + d for p, d in zip(pending, drafts.tokens, strict=True)])
        if tick is not None:
            tick()
        if first:
            _no_speech(main, hidden, live)
        index = [list(range(len(p) - 1, len(p) + len(d))) for p, d in zip(pending, drafts.tokens, strict=True)]
        logits = scored_logits(main.decoder, gather_positions(hidden, index), live, drafts.tokens)
        accepted = []
        for b, row in enumerate(live):
            n = len(drafts.tokens[b])
            scores = logits[b, : n + 1]
            if row.temperature > 0:
                scores = perturbed(scores, row.temperature, row.seed, len(row.tokens))
            choice = greedy_select(scores, drafts.tokens[b])
            new = [*drafts.tokens[b][: choice.accepted], choice.next_token]
            logprobs = torch.log_softmax(logits[b, : len(new)], dim=-1)
            chosen = logprobs.gather(-1, torch.tensor(new, device=logprobs.device).unsqueeze(-1)).flatten()
            kept = len(row.tokens)
            row.extend(new)
            # Sum the log-probabilities of what was kept, end-of-text included, as OpenAI's decoder does
            # (its average divides by the text's length plus one: the end).
            added = len(row.tokens) - kept
            row.logprobs.extend(chosen[:added].tolist())
            row.sum_logprob += float(chosen[: added + (row.finish == "stop")].sum())
            accepted.append(choice.accepted)
            s = stats[active[b]]
            s.drafted += n
            s.accepted += choice.accepted
            s.main_passes += 1
            s.draft_passes += draft_passes
        # The main cache holds the old tokens and the drafts; keep what was accepted.
        state.rewind([len(row.tokens) - 1 for row in live])
        if first and adopt:
            cast(PromptAdopting, draft).adopt(state)
        first = False
        if draft is not None:
            draft.update_candidate_strategy(live, accepted, [len(d) for d in drafts.tokens])
        keep = [b for b, row in enumerate(live) if row.finish is None]
        if len(keep) < len(live):
            state.keep(keep)
            active = [active[b] for b in keep]
    return [
        Decoded(row.generated, row.finish or "stop", row.sum_logprob, row.no_speech_prob, s, row.logprobs)
        for row, s in zip(rows, stats, strict=True)
    ]


@torch.inference_mode()
def detect_language(main: WhisperModel, cross: CrossKV) -> list[tuple[str, float]]:
    """Most likely language (code, probability) of each row from the main model's first prediction."""
    tok = main.tokenizer
    codes = list(tok.language_ids)
    ids = torch.tensor(list(tok.language_ids.values()), device=cross.keys[0].device)
    state = DecoderState.start(main.decoder, cross, cross.keys[0].shape[0])
    hidden, _ = state.feed([[tok.sot]] * cross.keys[0].shape[0])
    probs = main.decoder.logits(hidden[:, 0]).index_select(-1, ids).softmax(-1)
    best = probs.max(-1)
    return [(codes[i], float(p)) for i, p in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
