"""A chunk Whisper wrote too little of, decoded again in two halves.

Given a window of several readings or voices apart by pauses, Whisper sometimes writes the first and ends the
window there: on `bench-audio`'s speech with long pauses one chunk of three FLEURS readings (25 s of speech) came
back as 19 words, where the chunks around it wrote 2.4-3.0 words a second of speech. Decoded alone, each half of
that chunk is written whole (53 words).

So a chunk whose transcription holds fewer than `MIN_TOKENS_PER_S` tokens a second of its speech, over at least
`MIN_SPEECH_S` of speech, is cut at the pause between its speech regions nearest the middle of its speech, and
each half is transcribed as a chunk of its own, and cut in turn where it is written short. The halves replace the
chunk where they write at least `GAIN` times its tokens; otherwise the chunk's own transcription stands. A chunk of
one region is never cut (that would cut a word).

The rule reads nothing but the chunk and its transcription, so a request gets the same chunks and words whether
or not it is diarized.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from app.api.audio import SAMPLE_RATE
from app.api.types import Transcription
from app.server.serving.chunking import Chunk, Part

log = logging.getLogger(__name__)

MIN_SPEECH_S = 10.0
MIN_TOKENS_PER_S = 2.0  # English speech is written in 3-4 tokens a second
GAIN = 1.25


def written_short(transcription: Transcription, regions: Sequence[tuple[int, int]]) -> bool:
    """Whether a chunk's transcription is short for the speech in it (`regions`: [start, end) samples). Not where
    Whisper wrote nothing (it heard no speech: its halves would not be asked to find some) or stopped at the
    request's token limit (`max_new_tokens`)."""
    speech_s = sum(end - start for start, end in regions) / SAMPLE_RATE
    tokens = len(transcription.tokens)
    return transcription.finish == "stop" and speech_s >= MIN_SPEECH_S and 0 < tokens < MIN_TOKENS_PER_S * speech_s


def halving_point(regions: Sequence[tuple[int, int]]) -> int | None:
    """Where to cut a chunk (samples into its audio): the middle of the pause between two of its speech regions
    (in order) that comes nearest the middle of its speech; None for fewer than two regions."""
    if len(regions) < 2:
        return None
    half = sum(end - start for start, end in regions) / 2
    before, best = 0, None
    for k in range(1, len(regions)):
        before += regions[k - 1][1] - regions[k - 1][0]
        if best is None or abs(before - half) < best[0]:
            best = (abs(before - half), (regions[k - 1][1] + regions[k][0]) // 2)
    return best[1] if best is not None else None


async def written_in_full(
    chunk: Chunk,
    samples: np.ndarray,
    regions: Sequence[tuple[int, int]],
    transcribe: Callable[[Chunk, np.ndarray], Awaitable[tuple[Transcription, float]]],
    decoded_again: Callable[[bool], None] = lambda kept: None,
) -> list[Part]:
    """The chunk's transcription, or its halves' where Whisper wrote the chunk short (the module's rule; a half
    written short is halved in turn). `decoded_again(kept)` is told of each chunk or half decoded again in halves,
    and whether its halves stood.

    samples: [N] float32, the chunk's audio; regions: its speech ([start, end) samples of `samples`, in order)."""
    transcription, queued_ms = await transcribe(chunk, samples)
    whole = [(chunk, transcription, queued_ms)]
    cut = halving_point(regions) if written_short(transcription, regions) else None
    if cut is None or not 0 < cut < samples.size:
        return whole
    first, second = chunk.split(cut)
    before = [r for r in regions if r[1] <= cut]
    after = [(start - cut, end - cut) for start, end in regions if start >= cut]
    tasks = [
        asyncio.ensure_future(written_in_full(first, samples[:cut], before, transcribe, decoded_again)),
        asyncio.ensure_future(written_in_full(second, samples[cut:], after, transcribe, decoded_again)),
    ]
    try:
        halves = await asyncio.gather(*tasks)
    except BaseException:  # one half failed (or the request went away): the other is not wanted either
        for task in tasks:
            task.cancel()
        raise
    parts = [(c, t, queued_ms) for half in halves for c, t, _ in half]
    tokens = sum(len(t.tokens) for _, t, _ in parts)
    kept = tokens >= GAIN * len(transcription.tokens)
    log.debug(
        "a chunk of %.1f s of speech was written in %d tokens; in %d parts, %d tokens: %s",
        sum(end - start for start, end in regions) / SAMPLE_RATE,
        len(transcription.tokens),
        len(parts),
        tokens,
        "kept" if kept else "not kept",
    )
    decoded_again(kept)
    return parts if kept else whole
