"""A chunk Whisper wrote short is decoded again in halves (`app/server/serving/shortfall.py`).

The rule is tested here over a stand-in transcriber whose token counts the test sets; the real thing, through
a server, is `tests/test_chunking.py::test_readings_whisper_wrote_short_are_decoded_again_in_halves`."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from app.api.types import Metrics, Transcription
from app.server.serving.chunking import Chunk
from app.server.serving.shortfall import (
    GAIN,
    MIN_SPEECH_S,
    MIN_TOKENS_PER_S,
    halving_point,
    written_in_full,
    written_short,
)

SR = 16000


def _transcription(tokens: int) -> Transcription:
    metrics = Metrics(0.0, 0.0, 0.0, 0.0, tokens, 0, 0, 0.0, 1, 0, 0.0, 0.0, False, batch_size=1, windows=1)
    return Transcription("x" * tokens, list(range(tokens)), "en", 1.0, 0.0, [], "stop", metrics)


def test_a_chunk_is_split_at_a_point_of_its_audio() -> None:
    chunk = Chunk(((1000, 5000), (9000, 12000), (20000, 21000)))  # 4000 + 3000 + 1000 samples
    audio = np.arange(30000, dtype=np.float32)
    for at in (1, 2500, 4000, 5500, 7000, 7999):
        first, second = chunk.split(at)
        assert first.samples == at and second.samples == chunk.samples - at
        assert np.array_equal(np.concatenate([first.audio(audio), second.audio(audio)]), chunk.audio(audio))
    assert chunk.split(4000) == (Chunk(((1000, 5000),)), Chunk(((9000, 12000), (20000, 21000))))
    assert chunk.split(5000) == (Chunk(((1000, 5000), (9000, 10000))), Chunk(((10000, 12000), (20000, 21000))))


def test_the_cut_is_the_pause_nearest_the_middle_of_the_speech() -> None:
    regions = [(0, 4 * SR), (6 * SR, 8 * SR), (10 * SR, 14 * SR)]  # 4 + 2 + 4 s: the middle is in the second
    assert halving_point(regions) in (5 * SR, 9 * SR)
    assert halving_point([(0, 8 * SR), (10 * SR, 11 * SR), (12 * SR, 13 * SR)]) == 9 * SR
    assert halving_point([(0, 20 * SR)]) is None  # one region: cutting it would cut a word
    assert halving_point([]) is None


def test_short_is_few_tokens_for_much_speech() -> None:
    speech = [(0, int(MIN_SPEECH_S * SR))]
    enough = int(np.ceil(MIN_TOKENS_PER_S * MIN_SPEECH_S))
    assert written_short(_transcription(enough - 1), speech)
    assert not written_short(_transcription(enough), speech)
    assert not written_short(_transcription(1), [(0, int(MIN_SPEECH_S * SR) - 1)])  # too little speech to tell
    assert not written_short(_transcription(0), speech)  # Whisper heard no speech there
    assert not written_short(dataclasses.replace(_transcription(1), finish="length"), speech)  # max_new_tokens


def _run(
    tokens: dict[int, int], regions: list[tuple[int, int]], chunk: Chunk, told: list[bool] | None = None
) -> tuple[list[tuple[Chunk, Transcription, float]], list[Chunk]]:
    """written_in_full over a transcriber that writes tokens[len(audio)] tokens, and what it was asked; `told`
    collects what `decoded_again` was told."""
    asked: list[Chunk] = []
    told = [] if told is None else told

    async def transcribe(piece: Chunk, audio: np.ndarray) -> tuple[Transcription, float]:
        asked.append(piece)
        assert audio.size == piece.samples
        return _transcription(tokens[audio.size]), 7.0

    samples = np.zeros(chunk.samples, np.float32)
    return asyncio.run(written_in_full(chunk, samples, regions, transcribe, told.append)), asked


def test_halves_replace_a_chunk_written_short_where_they_write_more() -> None:
    chunk = Chunk(((0, 12 * SR), (20 * SR, 30 * SR)))  # 22 s
    regions = [(0, 10 * SR), (12 * SR, 22 * SR)]  # 20 s of speech, cut at 11 s
    first, second = chunk.split(11 * SR)
    parts, asked = _run({22 * SR: 20, 11 * SR: 30}, regions, chunk)
    assert asked == [chunk, first, second]
    assert [(c, len(t.tokens), q) for c, t, q in parts] == [(first, 30, 7.0), (second, 30, 7.0)]

    short = int(GAIN * 20) - 1  # the halves together: less than GAIN times the chunk's tokens
    told: list[bool] = []
    parts, _ = _run({22 * SR: 20, 11 * SR: short // 2}, regions, chunk, told)
    assert [(c, len(t.tokens)) for c, t, _ in parts] == [(chunk, 20)]
    assert told == [False]


def test_a_chunk_written_in_full_or_of_one_region_is_decoded_once() -> None:
    chunk = Chunk(((0, 22 * SR),))
    parts, asked = _run({22 * SR: 60}, [(0, 10 * SR), (12 * SR, 22 * SR)], chunk)
    assert asked == [chunk] and len(parts) == 1
    parts, asked = _run({22 * SR: 5}, [(0, 22 * SR)], chunk)
    assert asked == [chunk] and len(parts) == 1


def test_a_half_written_short_is_halved_in_turn() -> None:
    chunk = Chunk(((0, 28 * SR),))
    regions = [(0, 6 * SR), (7 * SR, 13 * SR), (15 * SR, 21 * SR), (22 * SR, 28 * SR)]  # 24 s of speech
    first, second = chunk.split(14 * SR)
    quarters = [*first.split(int(6.5 * SR)), *second.split(int(7.5 * SR))]
    # the chunk and each half written short; each quarter (6 s of speech: too little to cut) written whole
    told: list[bool] = []
    parts, asked = _run({28 * SR: 20, 14 * SR: 20, int(6.5 * SR): 18, int(7.5 * SR): 18}, regions, chunk, told)
    assert told == [True, True, True]  # each half, then the chunk
    assert asked[0] == chunk and set(asked[1:]) == {first, second, *quarters}
    assert [(c, len(t.tokens)) for c, t, _ in parts] == [(q, 18) for q in quarters]


def test_when_a_half_fails_the_other_is_stopped() -> None:
    chunk = Chunk(((0, 22 * SR),))
    regions = [(0, 10 * SR), (12 * SR, 22 * SR)]
    stopped: list[Chunk] = []

    async def transcribe(piece: Chunk, audio: np.ndarray) -> tuple[Transcription, float]:
        if piece == chunk:
            return _transcription(5), 0.0
        if piece.pieces[0][0] == 0:
            raise RuntimeError("the worker failed this half")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.append(piece)
            raise
        return _transcription(50), 0.0

    async def main() -> None:
        with pytest.raises(RuntimeError, match="failed this half"):
            await written_in_full(chunk, np.zeros(chunk.samples, np.float32), regions, transcribe)
        await asyncio.sleep(0)  # let the cancelled half see its cancellation
        assert stopped == [chunk.split(11 * SR)[1]]  # before the loop closes (which would cancel it anyway)

    asyncio.run(main())
