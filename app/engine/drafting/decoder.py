"""A Whisper text decoder as the draft: the three kinds of assistant this project ships.

- self-draft: an int8 copy of the main decoder that reads the main model's cross-attention keys/values;
- decoder-only (distil-whisper style): its own decoder over the main encoder's output;
- encoder-decoder: its own encoder and decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from app.engine.decoding.batch import DecoderState, Row, common_prefix, gather_positions, scored_logits
from app.engine.decoding.search import beam_step
from app.engine.decoding.selection import perturbed
from app.engine.drafting.base import DraftInputs, DraftLength, Drafts
from app.model.decoder import TextDecoder
from app.model.whisper import WhisperModel

CrossSource = Literal["main-cross", "main-encoder", "own-encoder"]

ADOPT_MIN_PROMPT = 32  # tokens of the longest prompt from which a self-draft adopts the main cache


@dataclass
class _DraftHyp:
    """A drafted continuation of rows[row]: its tokens after the row's and their summed log-probability."""

    row: int
    drafted: list[int]
    score: float


# A beam's drafted tree: at most this many steps ahead, and this many paths per hypothesis of its width. Each
# drafted step costs a pass over every hypothesis, and each path a row of the main pass (docs/performance.md).
BEAM_DEPTH = 3
BEAM_PATHS = 1.5


class DecoderDraftSession:
    """Drafts from a decoder's own cache: a chain per greedy row, the draft's own beam search for beam rows.

    Each cache row holds a prefix of some hypothesis (`held`); a call finds for every row the cache row that
    shares most of its tokens, so rows may fork, die and reorder between calls (beam hypotheses do).

    adopt_min_prompt: a self-draft (same layout as the main decoder) takes the main model's keys/values
    of prompts this long (previous text in long-form audio) instead of prefilling them on the int8
    path; it costs one pass without drafts per window (docs/history/performance-log.md). None: never.
    beam_paths: the most paths (rows of the main pass) a beam's drafted tree may give per hypothesis of its
    width; the deepest are kept. beam_depth: the most steps a beam's draft looks ahead.
    """

    def __init__(
        self,
        state: DecoderState,
        length: DraftLength,
        adopt_min_prompt: int | None = None,
        beam_paths: float = BEAM_PATHS,
        beam_depth: int = BEAM_DEPTH,
    ) -> None:
        self.state = state
        self.beam_depth = beam_depth
        self.entries = state.cross  # row b of the first call (group b) reads entry b
        self.length = length
        self.adopt_min_prompt = adopt_min_prompt
        self.beam_paths = beam_paths
        self.held: list[list[int]] = [[] for _ in state.fed]
        self.k: dict[int, int] = {}  # draft length (beam steps) per group
        self.passes = 0

    def _attach(self, rows: Sequence[Row]) -> None:
        """Make cache row b hold the longest cached prefix of rows[b].tokens (all but its last token at most)."""
        picks, fed = [], []
        for b, row in enumerate(rows):
            order = [b, *(c for c in range(len(self.held)) if c != b)] if b < len(self.held) else range(len(self.held))
            best, shared = 0, -1
            for c in order:
                n = common_prefix(self.held[c], row.tokens)
                if n > shared:
                    best, shared = c, n
                if shared >= len(row.tokens) - 1:
                    break
            picks.append(best)
            fed.append(min(shared, len(row.tokens) - 1))
        self.state.regroup(picks, fed, self.entries.rows([row.group for row in rows]))
        self.held = [row.tokens[:n] for row, n in zip(rows, fed, strict=True)]

    def get_candidates(self, rows: Sequence[Row], budgets: Sequence[int]) -> Drafts:
        if not rows:
            return Drafts([])
        self._attach(rows)
        runs: list[tuple[int, int]] = []  # (first row, end row) of each group
        for b, row in enumerate(rows):
            if runs and rows[runs[-1][0]].group == row.group and row.beam > 1:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
        want = [min(self.k.get(rows[a].group, self.length.initial), *budgets[a:z]) for a, z in runs]
        want = [min(w, self.beam_depth) if rows[a].beam > 1 else w for w, (a, _) in zip(want, runs, strict=True)]
        if max(want) == 0:
            return Drafts.empty(len(rows))
        nodes: list[set[tuple[int, ...]]] = [set() for _ in rows]
        hyps = [[_DraftHyp(b, [], rows[b].sum_logprob) for b in range(a, z)] for a, z in runs]
        open_runs = [w > 0 for w in want]
        steps = [0] * len(runs)
        # Step 0 feeds whatever each row gained since its cache row was filled (prompt, accepted drafts, corrections).
        feeds = [row.tokens[n:] for row, n in zip(rows, self.state.fed, strict=True)]
        while any(open_runs):
            flat = [h for group in hyps for h in group]
            hidden, feed = self.state.feed(feeds)
            self.passes += 1
            last = gather_positions(hidden, [[max(n - 1, 0)] for n in feed.lengths])
            logits = scored_logits(
                self.state.decoder,
                last,
                [rows[h.row] for h in flat],
                [h.drafted for h in flat],
                [len(h.drafted) for h in flat],
            )[:, 0]
            sources: list[int] = []
            feeds = []
            at = 0
            for g, (a, _) in enumerate(runs):
                group = hyps[g]
                here = logits[at : at + len(group)]
                if not open_runs[g]:
                    grown = [(at + i, h, False) for i, h in enumerate(group)]
                elif rows[a].beam == 1:
                    grown = [(at, self._chain_step(group[0], rows[a], here[0]), True)]
                    open_runs[g] = len(grown[0][1].drafted) < want[g] and grown[0][1].drafted[-1] != rows[a].eot
                    if open_runs[g] and self.length.confidence > 0.0:
                        open_runs[g] = float(here[0].softmax(-1).max()) >= self.length.confidence
                else:
                    step = beam_step(here, [h.score for h in group], rows[a].beam, rows[a].eot)
                    grown = []
                    for c in step.kept:
                        parent = group[c.parent]
                        grown.append((at + c.parent, _DraftHyp(parent.row, [*parent.drafted, c.token], c.score), True))
                    steps[g] += 1
                    open_runs[g] = steps[g] < want[g] and bool(grown)
                for source, h, new in grown:
                    if new:
                        nodes[h.row].add(tuple(h.drafted))
                    sources.append(source)
                    feeds.append([h.drafted[-1]] if new and open_runs[g] else [])
                hyps[g] = [h for _, h, _ in grown]
                at += len(group)
            flat = [h for group in hyps for h in group]
            fed = [self.state.fed[c] for c in sources]
            self.state.regroup(sources, fed, self.entries.rows([rows[h.row].group for h in flat]))
        flat = [h for group in hyps for h in group]
        self.held = [(rows[h.row].tokens + h.drafted)[:n] for h, n in zip(flat, self.state.fed, strict=True)]
        return Drafts(self._paths(rows, runs, nodes))

    def _chain_step(self, h: _DraftHyp, row: Row, logits: Tensor) -> _DraftHyp:
        """A greedy row's next drafted token (a sampling row's: the argmax under the noise the main model will use)."""
        if row.temperature > 0:
            position = len(row.tokens) + len(h.drafted)
            token = int(perturbed(logits[None], row.temperature, row.seed, position).argmax())
        else:
            token = int(logits.argmax())
        return _DraftHyp(h.row, [*h.drafted, token], h.score)

    def _paths(
        self, rows: Sequence[Row], runs: list[tuple[int, int]], nodes: list[set[tuple[int, ...]]]
    ) -> list[list[list[int]]]:
        """Each row's drafted tree as root-to-leaf paths, a beam's deepest first within its budget of paths."""
        paths: list[list[list[int]]] = [[] for _ in rows]
        for a, z in runs:
            leaves = []
            for b in range(a, z):
                ordered = sorted(nodes[b], key=len, reverse=True)
                kept: list[tuple[int, ...]] = []
                for node in ordered:
                    if not any(leaf[: len(node)] == node for leaf in kept):
                        kept.append(node)
                leaves += [(b, leaf) for leaf in kept]
            if rows[a].beam > 1:
                limit = max(z - a, round(rows[a].beam * self.beam_paths))
                leaves = sorted(leaves, key=lambda item: len(item[1]), reverse=True)[:limit]
            for b, leaf in leaves:
                paths[b].append(list(leaf))
        return paths

    def update_candidate_strategy(self, rows: Sequence[Row], accepted: Sequence[int], proposed: Sequence[int]) -> None:
        seen = set()
        for row, a, p in zip(rows, accepted, proposed, strict=True):
            if row.group not in seen:
                seen.add(row.group)
                self.k[row.group] = self.length.next(self.k.get(row.group, self.length.initial), a, p)

    def adopts_prompt(self, rows: Sequence[Row]) -> bool:
        limit = self.adopt_min_prompt
        return limit is not None and max(row.prompt_len for row in rows) >= limit and not any(self.held)

    def adopt(self, main: DecoderState, rows: Sequence[Row]) -> None:
        """Copy the main cache's first max(main.fed) slots of every layer (rows beyond their own count are
        overwritten before they are read, as after a rewind)."""
        n = max(main.fed)
        mine, theirs = self.state.cache, main.cache
        if len(mine.keys) != len(theirs.keys) or mine.keys[0].shape[:2] != theirs.keys[0].shape[:2]:
            raise ValueError("a draft adopts only the cache of a main decoder with its own layout")
        for dst, src in zip([*mine.keys, *mine.values], [*theirs.keys, *theirs.values], strict=True):
            dst[:, :, :n].copy_(src[:, :, :n])
        self.state.fed = list(main.fed)
        self.held = [row.tokens[:f] for row, f in zip(rows, main.fed, strict=True)]


AUDIO_MARGIN_FRAMES = 200  # encoder frames (4 s) past the audio that a draft still attends to


class DecoderDrafter:
    """A drafter made of a Whisper text decoder; `cross` says where its cross-attention reads from.

    audio_margin: a draft reading the main encoder attends only to the frames that hold audio plus
    this many (None: all 1500). A 10-s clip leaves 1000 frames of encoded padding that the main
    model reads but a draft needs less: on the benchdata clips a margin of 50 frames cut the
    speculative decode time by 19-24%; with the int8 kernel's more faithful draft, 200 frames keep
    more of its acceptance for little more reading (docs/history/performance-log.md). Only the draft changes;
    the main model, which decides every token, still reads all frames: the output is unchanged.

    adopt_min_prompt: for a self-draft ("main-cross"), the prompt length (longest row) from which the
    draft takes the main model's cache of the prompt instead of prefilling it (None: never).
    """

    def __init__(
        self,
        name: str,
        decoder: TextDecoder,
        cross: CrossSource,
        encoder_model: WhisperModel | None = None,
        length: DraftLength | None = None,
        audio_margin: int | None = AUDIO_MARGIN_FRAMES,
        adopt_min_prompt: int | None = ADOPT_MIN_PROMPT,
    ) -> None:
        if cross == "own-encoder" and (encoder_model is None or encoder_model.encoder is None):
            raise ValueError("an encoder-decoder assistant needs its encoder")
        self.name = name
        self.decoder = decoder
        self.cross = cross
        self.encoder_model = encoder_model
        self.length = length or DraftLength()
        self.audio_margin = audio_margin
        # Only a self-draft's cache holds what the main decoder's does (its int8 twin computes the same keys).
        self.adopt_min_prompt = adopt_min_prompt if cross == "main-cross" else None

    @torch.inference_mode()
    def start(self, inputs: DraftInputs) -> DecoderDraftSession:
        frames = inputs.encoder_out.shape[1]
        if self.audio_margin is not None and inputs.audio_frames is not None:
            frames = min(frames, inputs.audio_frames + self.audio_margin)
        if self.cross == "main-cross":
            # Views: a copy would cost memory and time, not speed. A half-precision main model's keys and
            # values are copied (only those frames) for the fp32 int8 draft (`int8.int8_draft_decoder`).
            cross = inputs.main_cross.frames(frames, self.decoder.dtype)
        elif self.cross == "main-encoder":
            cross = self.decoder.cross_kv(inputs.encoder_out[:, :frames].to(self.decoder.dtype))
        else:
            assert self.encoder_model is not None
            cross = self.decoder.cross_kv(self.encoder_model.encode(inputs.features))
        state = DecoderState.start(self.decoder, cross, cross.batch, inputs.capacity)
        return DecoderDraftSession(state, self.length, self.adopt_min_prompt)
