"""A Whisper text decoder as the draft: the three kinds of assistant this project ships.

- self-draft: an int8 copy of the main decoder that reads the main model's cross-attention keys/values;
- decoder-only (distil-whisper style): its own decoder over the main encoder's output;
- encoder-decoder: its own encoder and decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from app.engine.decoding.batch import DecoderState, Row, gather_positions, scored_logits
from app.engine.decoding.selection import perturbed
from app.engine.drafting.base import DraftInputs, DraftLength, Drafts
from app.model.decoder import CrossKV, TextDecoder
from app.model.whisper import WhisperModel

CrossSource = Literal["main-cross", "main-encoder", "own-encoder"]

ADOPT_MIN_PROMPT = 32  # tokens of the longest prompt from which a self-draft adopts the main cache


class DecoderDraftSession:
    """Drafts from a decoder's own cache of each row.

    adopt_min_prompt: a self-draft (same layout as the main decoder) takes the main model's keys/values
    of prompts this long (previous text in long-form audio) instead of prefilling them on the int8
    path; it costs one pass without drafts per window (docs/history/performance-log.md). None: never.
    """

    def __init__(self, state: DecoderState, length: DraftLength, adopt_min_prompt: int | None = None) -> None:
        self.state = state
        self.length = length
        self.adopt_min_prompt = adopt_min_prompt
        self.k = [length.initial] * len(state.fed)
        self.passes = 0

    def get_candidates(self, rows: Sequence[Row], budgets: Sequence[int]) -> Drafts:
        want = [min(k, budget) for k, budget in zip(self.k, budgets, strict=True)]
        drafts: list[list[int]] = [[] for _ in rows]
        if max(want) == 0:
            return Drafts.empty(len(rows))
        # Step 0 feeds whatever each row gained since the last draft (prompt, accepted drafts, correction).
        feeds = [row.tokens[fed:] for row, fed in zip(rows, self.state.fed, strict=True)]
        open_rows = [w > 0 for w in want]
        while any(open_rows):
            hidden, feed = self.state.feed(feeds)
            self.passes += 1
            last = gather_positions(hidden, [[max(n - 1, 0)] for n in feed.lengths])
            logits = scored_logits(self.state.decoder, last, rows, drafts, [len(d) for d in drafts])[:, 0]
            best = logits.argmax(-1).tolist()
            for b, row in enumerate(rows):  # a sampling row guesses with the noise the main model will use
                if open_rows[b] and row.temperature > 0:
                    position = len(row.tokens) + len(drafts[b])
                    best[b] = int(perturbed(logits[b : b + 1], row.temperature, row.seed, position).argmax())
            if self.length.confidence > 0.0:
                confident = (logits.softmax(-1).max(-1).values >= self.length.confidence).tolist()
            else:
                confident = [True] * len(rows)
            feeds = []
            for b, row in enumerate(rows):
                token = best[b]
                if open_rows[b]:
                    drafts[b].append(token)
                    open_rows[b] = len(drafts[b]) < want[b] and confident[b] and token != row.eot
                feeds.append([token] if open_rows[b] else [])
        # Every draft but the last of each row now sits in the draft cache.
        return Drafts(drafts)

    def update_candidate_strategy(self, rows: Sequence[Row], accepted: Sequence[int], proposed: Sequence[int]) -> None:
        # The cache holds the old tokens and the drafts; the accepted ones match the extended rows.
        self.state.rewind([len(row.tokens) - 1 for row in rows])
        self.k = [self.length.next(k, a, p) for k, a, p in zip(self.k, accepted, proposed, strict=True)]
        keep = [b for b, row in enumerate(rows) if row.finish is None]
        if len(keep) < len(rows):
            self.state.keep(keep)
            self.k = [self.k[b] for b in keep]

    def adopts_prompt(self, rows: Sequence[Row]) -> bool:
        limit = self.adopt_min_prompt
        return limit is not None and max(row.prompt_len for row in rows) >= limit and not any(self.state.fed)

    def adopt(self, main: DecoderState) -> None:
        """Copy the main cache's first max(main.fed) slots of every layer (rows beyond their own count are
        overwritten before they are read, as after a rewind)."""
        n = max(main.fed)
        mine, theirs = self.state.cache, main.cache
        if len(mine.keys) != len(theirs.keys) or mine.keys[0].shape[:2] != theirs.keys[0].shape[:2]:
            raise ValueError("a draft adopts only the cache of a main decoder with its own layout")
        for dst, src in zip([*mine.keys, *mine.values], [*theirs.keys, *theirs.values], strict=True):
            dst[:, :, :n].copy_(src[:, :, :n])
        self.state.fed = list(main.fed)


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
            dtype = self.decoder.dtype
            cross = CrossKV(
                [k[:, :, :frames].to(dtype) for k in inputs.main_cross.keys],
                [v[:, :, :frames].to(dtype) for v in inputs.main_cross.values],
            )
        elif self.cross == "main-encoder":
            cross = self.decoder.cross_kv(inputs.encoder_out[:, :frames].to(self.decoder.dtype))
        else:
            assert self.encoder_model is not None
            cross = self.decoder.cross_kv(self.encoder_model.encode(inputs.features))
        state = DecoderState.start(self.decoder, cross, inputs.encoder_out.shape[0], inputs.capacity)
        return DecoderDraftSession(state, self.length, self.adopt_min_prompt)
