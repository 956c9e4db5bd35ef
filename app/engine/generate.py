"""The decoding loop: every request's search (greedy, sampling or beam) advanced together, with or without drafts.

Each iteration a drafter (if any) proposes tokens after the hypotheses of the searches that draft; the main
model feeds, per branch (a hypothesis followed by drafted tokens, `app.engine.decoding.search`), the tokens its
cache does not hold yet followed by the drafts, all branches in one forward pass, and scores the next token at
every drafted position. Each search then grows its hypotheses from those logits (a greedy row keeps the longest
prefix of drafts equal to the main model's own choices plus the main model's next token; a beam replays its
steps over the scored nodes) and says which branch's cache each new hypothesis continues; the cache rows are
regrouped accordingly (a beam's hypotheses share their prefixes). Without a drafter every branch is a bare
hypothesis and the same loop is plain decoding, one token or one beam step per pass: all modes share every rule
and every op, which is what makes their outputs identical, sampled ones included.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import cast

import torch

from app.engine.decoding.batch import DecoderState, Row, gather_positions
from app.engine.decoding.search import Branch, Decoded, Greedy, RowStats, Scored, Search
from app.engine.drafting.base import DraftSession, PromptAdopting
from app.model.decoder import CrossKV
from app.model.whisper import WhisperModel

__all__ = ["Decoded", "RowStats", "decode", "detect_language"]


def _no_speech(main: WhisperModel, hidden: torch.Tensor, rows: Sequence[Row]) -> list[float]:
    """Probability of <|nospeech|> at each row's start-of-transcript position (first pass only)."""
    at_sot = gather_positions(hidden, [[row.sot_index] for row in rows])[:, 0]
    return main.decoder.logits(at_sot).softmax(-1)[:, main.tokenizer.no_speech].tolist()  # type: ignore[no-any-return]


@torch.inference_mode()
def decode(
    main: WhisperModel,
    cross: CrossKV,
    audio: Sequence[int],
    searches: Sequence[Search],
    draft: DraftSession | None,
    tick: Callable[[], None] | None = None,
) -> list[Decoded]:
    """Advance every search to its end; search i reads entry audio[i] of `cross`. The draft session, if any,
    proposes for every search's hypotheses (each row's `group` is its search's index: the draft's inputs hold one
    entry per search, in order); a row that does not draft has no budget.

    tick() is called after each main-model pass (a caller's sign of life; it must be cheap)."""
    live = [i for i, search in enumerate(searches) if not search.done]
    for i in live:
        for row in searches[i].rows:
            row.group = i

    def cross_of(owners: Sequence[int]) -> CrossKV:
        return cross.rows([audio[i] for i in owners])

    owners = [i for i in live for _ in searches[i].rows]
    capacity = max(row.max_len for i in live for row in searches[i].rows)
    state = DecoderState.start(main.decoder, cross_of(owners), len(owners), capacity=capacity)
    first = True
    # A draft that takes the main model's cache of a long prompt waits for the first pass to fill it (its rows
    # must be the main model's: only when every search is greedy).
    adopt = (
        isinstance(draft, PromptAdopting)
        and all(isinstance(searches[i], Greedy) for i in live)
        and draft.adopts_prompt([searches[i].rows[0] for i in live])
    )
    while live:
        rows = [row for i in live for row in searches[i].rows]
        offsets = dict(zip(live, itertools.accumulate((len(searches[i].rows) for i in live), initial=0), strict=False))
        proposals: dict[int, list[list[list[int]]]] = {}
        draft_passes = 0
        if draft is not None and not (first and adopt):
            before = draft.passes
            drafts = draft.get_candidates(rows, [row.draft_budget for row in rows])
            draft_passes = draft.passes - before
            proposals = {i: drafts.paths[offsets[i] : offsets[i] + len(searches[i].rows)] for i in live}
        per_search = {i: searches[i].branches(proposals.get(i, [])) for i in live}
        flat = [(i, branch) for i in live for branch in per_search[i]]
        sources = [offsets[i] + branch.hyp for i, branch in flat]
        if sources != list(range(len(rows))):
            state.regroup(sources, [state.fed[r] for r in sources], cross_of([i for i, _ in flat]))
        branch_rows = [rows[r] for r in sources]
        paths = [branch.path for _, branch in flat]
        pending = [row.tokens[fed:] for row, fed in zip(branch_rows, state.fed, strict=True)]
        hidden, _ = state.feed([p + path for p, path in zip(pending, paths, strict=True)])
        if tick is not None:
            tick()
        if first:
            firsts: dict[int, int] = {}
            for b, (i, _) in enumerate(flat):
                firsts.setdefault(i, b)
            index = torch.tensor(list(firsts.values()), device=hidden.device)
            probs = _no_speech(main, hidden.index_select(0, index), [branch_rows[b] for b in firsts.values()])
            for i, p in zip(firsts, probs, strict=True):
                searches[i].no_speech_prob = p
        scored = Scored(main.decoder, hidden, branch_rows, paths, [len(p) for p in pending])
        at, wanted = 0, []  # the nodes every search reads, scored in one product
        for i in live:
            wanted += [(at + b, d) for b, d in searches[i].nodes(per_search[i])]
            at += len(per_search[i])
        scored.at(wanted)
        sources, fed, at = [], [], 0
        for i in live:
            branches: list[Branch] = per_search[i]
            continuations = searches[i].advance(scored, at, branches)
            if not searches[i].done:
                for c in continuations:
                    sources.append(at + c.branch)
                    fed.append(min(c.cached, len(c.row.tokens) - 1))
            at += len(branches)
            searches[i].stats.draft_passes += draft_passes
        if first and adopt:  # every search is greedy: the branches are the draft's rows, now extended
            state.rewind([len(row.tokens) - 1 for row in branch_rows])
            cast(PromptAdopting, draft).adopt(state, branch_rows)
        if draft is not None and proposals:
            moves = [searches[i].last_move for i in live]
            draft.update_candidate_strategy(
                [rows[offsets[i]] for i in live], [m[0] for m in moves], [m[1] for m in moves]
            )
        live = [i for i in live if not searches[i].done]
        state.regroup(sources, fed, cross_of([i for i in live for _ in searches[i].rows]))
        first = False
    return [search.result() for search in searches]


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
