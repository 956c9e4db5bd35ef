"""The decoding loop: greedy decoding, with or without drafts, for a batch of rows.

Each iteration a drafter (if any) proposes up to k tokens per row; the main model
feeds, per row, the tokens it has not seen yet followed by the drafts, in one
forward pass, and predicts the next token at every drafted position. A row keeps
the longest prefix of drafts that matches the main model's own predictions, plus
the main model's next token. Without a drafter k is 0 and the same loop is plain
greedy decoding, one token per pass: both modes share every rule and every op,
which is what makes their outputs identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.batch import DecoderState, Row, gather_positions, scored_logits
from app.engine.decoder import CrossKV
from app.engine.draft import DraftSession
from app.engine.model import WhisperModel


@dataclass
class RowStats:
    """Counters of one row over its decoding."""

    drafted: int = 0
    accepted: int = 0
    main_passes: int = 0
    draft_passes: int = 0


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]
    finish: str
    stats: RowStats


def _accepted_prefix(drafts: list[int], predicted: list[int]) -> int:
    m = 0
    while m < len(drafts) and drafts[m] == predicted[m]:
        m += 1
    return m


@torch.inference_mode()
def decode(main: WhisperModel, cross: CrossKV, rows: list[Row], draft: DraftSession | None) -> list[Decoded]:
    """Decode all rows to end-of-text or their length limit; rows leave the batch as they finish."""
    state = DecoderState.start(main.decoder, cross, len(rows))
    stats = [RowStats() for _ in rows]
    active = list(range(len(rows)))
    draft_passes = 0
    while active:
        live = [rows[i] for i in active]
        if draft is not None:
            before = draft.passes
            drafts = draft.get_candidates(live, [row.draft_budget for row in live])
            draft_passes = draft.passes - before
        else:
            drafts = [[] for _ in live]
        pending = [row.tokens[fed:] for row, fed in zip(live, state.fed, strict=True)]
        hidden, _ = state.feed([p + d for p, d in zip(pending, drafts, strict=True)])
        index = [list(range(len(p) - 1, len(p) + len(d))) for p, d in zip(pending, drafts, strict=True)]
        predicted = (
            scored_logits(main.decoder, gather_positions(hidden, index), live, drafts).argmax(-1).tolist()
        )
        accepted = []
        for b, row in enumerate(live):
            m = _accepted_prefix(drafts[b], predicted[b])
            accepted.append(m)
            row.extend([*drafts[b][:m], predicted[b][m]])
            s = stats[active[b]]
            s.drafted += len(drafts[b])
            s.accepted += m
            s.main_passes += 1
            s.draft_passes += draft_passes
        # The main cache holds the old tokens and the drafts; keep what was accepted.
        state.rewind([len(row.tokens) - 1 for row in live])
        if draft is not None:
            draft.update_candidate_strategy(live, accepted, [len(d) for d in drafts])
        keep = [b for b, row in enumerate(live) if row.finish is None]
        if len(keep) < len(live):
            state.keep(keep)
            if draft is not None:
                draft.keep(keep)
            active = [active[b] for b in keep]
    return [Decoded(row.generated, row.finish or "stop", s) for row, s in zip(rows, stats, strict=True)]


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
