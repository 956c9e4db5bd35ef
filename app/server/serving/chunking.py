"""An upload's `chunking_strategy`: speech regions -> chunks of at most 30 s -> one transcription, on its timeline.

The VAD's speech regions (each padded, none longer than a chunk) are packed in order into chunks: a
chunk is the concatenation of whole regions, the silence between them left out, up to `CHUNK_SECONDS`
of audio. Each chunk is decoded as one clip (the batcher runs several in a batch); its segment and word
times, which count seconds of the chunk, are mapped back through its pieces to seconds of the upload and
kept within the upload's end. Non-speech is never decoded, so it produces no text.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from app.api.audio import SAMPLE_RATE
from app.api.types import Metrics, Segment, Transcription

CHUNK_SECONDS = 30.0


@dataclass(frozen=True)
class Chunk:
    """Pieces of the upload ([start, end) samples, in order), decoded as one clip."""

    pieces: tuple[tuple[int, int], ...]

    @property
    def samples(self) -> int:
        return sum(end - start for start, end in self.pieces)

    @property
    def seams(self) -> list[int]:
        """Where its pieces meet, as samples of its audio."""
        return list(itertools.accumulate(end - start for start, end in self.pieces[:-1]))

    def audio(self, audio: np.ndarray) -> np.ndarray:
        return np.concatenate([audio[start:end] for start, end in self.pieces])

    def split(self, at: int) -> tuple[Chunk, Chunk]:
        """The chunk cut `at` samples into its audio (0 < at < `samples`): the audio before, the audio after."""
        first: list[tuple[int, int]] = []
        second: list[tuple[int, int]] = []
        offset = 0
        for start, end in self.pieces:
            if offset + end - start <= at:
                first.append((start, end))
            elif offset >= at:
                second.append((start, end))
            else:
                first.append((start, start + at - offset))
                second.append((start + at - offset, end))
            offset += end - start
        return Chunk(tuple(first)), Chunk(tuple(second))

    def to_original(self, t: float, *, is_end: bool = False) -> float:
        """Seconds into the chunk -> seconds into the upload. A time on a seam between two pieces belongs
        to the piece it ends (`is_end`) or starts."""
        starts = np.cumsum([0] + [end - start for start, end in self.pieces[:-1]]).tolist()
        sample = round(t * SAMPLE_RATE, 6)  # a time on a seam stays on it, whatever its float's last bits
        k = (bisect.bisect_left if is_end else bisect.bisect_right)(starts, sample) - 1
        k = min(max(k, 0), len(self.pieces) - 1)
        return (self.pieces[k][0] + sample - starts[k]) / SAMPLE_RATE


Part = tuple[Chunk, Transcription, float]  # a chunk, its transcription and the time it queued (ms)


class ChunkPacker:
    """Packs speech regions, in order, into chunks of at most `max_seconds` of audio (a longer region, which the VAD
    should not give, is cut): `add` returns the chunks a region closes, `finish` the last one."""

    def __init__(self, max_seconds: float = CHUNK_SECONDS) -> None:
        self.limit = int(max_seconds * SAMPLE_RATE)
        self._pieces: list[tuple[int, int]] = []
        self._size = 0

    def add(self, start: int, end: int) -> list[Chunk]:
        closed: list[Chunk] = []
        while end - start > self.limit:  # not from the VAD, which cuts long speech at a pause
            closed += self.finish()
            closed.append(Chunk(((start, start + self.limit),)))
            start += self.limit
        if self._size + end - start > self.limit:
            closed += self.finish()
        self._pieces.append((start, end))
        self._size += end - start
        return closed

    def finish(self) -> list[Chunk]:
        if not self._pieces:
            return []
        chunk = Chunk(tuple(self._pieces))
        self._pieces, self._size = [], 0
        return [chunk]


def plan(regions: Iterable[tuple[int, int]], max_seconds: float = CHUNK_SECONDS) -> Iterator[Chunk]:
    """`ChunkPacker` over these regions: each chunk yielded as soon as the next region does not fit in it."""
    packer = ChunkPacker(max_seconds)
    for start, end in regions:
        yield from packer.add(start, end)
    yield from packer.finish()


def _span(chunk: Chunk, start: float, end: float, duration: float) -> tuple[float, float]:
    """A segment's or word's times in the chunk as times in the upload, within its `duration` (s)."""
    first = min(chunk.to_original(start), duration)
    last = min(max(chunk.to_original(end, is_end=True), first), duration)
    return round(first, 3), round(last, 3)


def _segments(chunks: Sequence[Chunk], parts: Sequence[Transcription], duration: float) -> list[Segment]:
    segments: list[Segment] = []
    for chunk, part in zip(chunks, parts, strict=True):
        seek = round(chunk.pieces[0][0] / SAMPLE_RATE * 100)  # mel frames (10 ms) into the upload
        for s in part.segments:
            words = []
            for w in s.words:
                start, end = _span(chunk, w.start, w.end, duration)
                words.append(replace(w, start=start, end=end))
            start, end = _span(chunk, s.start, s.end, duration)
            segments.append(replace(s, id=len(segments), seek=seek, start=start, end=end, words=words))
    return segments


def _metrics(parts: Sequence[Transcription], duration: float) -> Metrics:
    """The chunks' measurements together; a batch's encode and decode time is shared among its rows."""
    ms = [p.metrics for p in parts]
    drafted = sum(m.draft_proposed for m in ms)
    accepted = sum(m.draft_accepted for m in ms)
    passes = sum(m.main_passes for m in ms)
    tokens = sum(m.tokens for m in ms)
    total_ms = sum(m.total_ms / m.batch_size for m in ms)
    return Metrics(
        audio_seconds=round(duration, 3),
        encode_ms=round(sum(m.encode_ms / m.batch_size for m in ms), 2),
        decode_ms=round(sum(m.decode_ms / m.batch_size for m in ms), 2),
        total_ms=round(total_ms, 2),
        tokens=tokens,
        draft_proposed=drafted,
        draft_accepted=accepted,
        acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
        main_passes=passes,
        draft_passes=sum(m.draft_passes for m in ms),
        tokens_per_main_pass=round(tokens / passes, 3) if passes else 0.0,
        real_time_factor=round(total_ms / 1000 / duration, 4) if duration else 0.0,
        speculative=any(m.speculative for m in ms),
        batch_size=max((m.batch_size for m in ms), default=1),
        windows=sum(m.windows for m in ms),
        decoding=ms[0].decoding if ms else "greedy",
        beam_size=ms[0].beam_size if ms else 1,
    )


def merge(
    chunks: Sequence[Chunk], parts: Sequence[Transcription], duration: float, language: str | None
) -> Transcription:
    """The chunks' transcriptions as one, on the upload's timeline (`duration` s). `language`: the request's, else
    the language most of the speech was detected in."""
    if language is None:
        spoken: Counter[str] = Counter()
        for chunk, part in zip(chunks, parts, strict=True):
            if part.language is not None:
                spoken[part.language] += chunk.samples
        language = spoken.most_common(1)[0][0] if spoken else None
    probability = next((p.language_probability for p in parts if p.language == language), None)
    segments = _segments(chunks, parts, duration)
    finish = next((p.finish for p in parts if p.finish != "stop"), "stop")
    return Transcription(
        text="".join(s.text for s in segments).strip(),
        tokens=[t for p in parts for t in p.tokens],
        language=language,
        language_probability=probability,
        duration=round(duration, 3),
        segments=segments,
        finish=finish,
        metrics=_metrics(parts, duration),
    )
