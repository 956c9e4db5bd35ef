"""A long-form window's words: OpenAI's `add_word_timestamps` rules, which place the aligned words in the window's
segments, and its hallucination checks (`hallucination_silence_threshold`), which judge how unlike speech a
segment's words are. `LongFormJob.place_words` uses both."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.api.types import Word
from app.engine.alignment import APPEND_PUNCTUATION, PREPEND_PUNCTUATION, WordTiming, merge_punctuation

PUNCTUATION = PREPEND_PUNCTUATION + APPEND_PUNCTUATION  # not words, for the hallucination check (as OpenAI's)
SENTENCE_ENDS = ".。!！?？"


@dataclass
class WindowSegment:
    """A segment of the window being decoded, before it is committed (times in seconds of the audio)."""

    seek: int
    start: float
    end: float
    tokens: list[int]
    text: str
    logprobs: list[float]  # of each of its tokens
    words: list[Word] = field(default_factory=list)


def last_end_of(segments: list[WindowSegment]) -> float | None:
    """The last word's end, else the last segment's end (OpenAI's `get_end`)."""
    return next((w.end for s in reversed(segments) for w in reversed(s.words)), segments[-1].end if segments else None)


def _anomaly(word: Word) -> float:
    """How unlike a spoken word it is: improbable, very short or very long."""
    duration = word.end - word.start
    score = 1.0 if word.probability < 0.15 else 0.0
    if duration < 0.133:
        score += (0.133 - duration) * 15
    if duration > 2.0:
        score += duration - 2.0
    return score


def is_anomaly(segment: WindowSegment | None) -> bool:
    if segment is None or not segment.words:
        return False
    words = [w for w in segment.words if w.word not in PUNCTUATION][:8]
    score = sum(_anomaly(w) for w in words)
    return score >= 3 or score + 0.01 >= len(words)


def with_words(segments: list[WindowSegment]) -> WindowSegment | None:
    return next((s for s in segments if s.words), None)


def add_words(
    segments: list[WindowSegment], timings: list[WordTiming], offset: float, last_speech: float, eot: int
) -> None:
    """OpenAI's `add_word_timestamps`: cap words at sentence ends, merge punctuation, give each of a window's
    segments its words (`timings`: aligned over its text tokens, in seconds of the window starting at `offset`;
    times rounded to 10 ms), and let words and segment bounds correct each other. `last_speech`: where the last
    word before the window ended; `eot`: the first token that is not text."""
    if not segments:
        return
    durations = np.array([t.end - t.start for t in timings])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):
        for i in range(1, len(timings)):
            if timings[i].end - timings[i].start > longest:
                if timings[i].word in SENTENCE_ENDS:
                    timings[i].end = timings[i].start + longest
                elif timings[i - 1].word in SENTENCE_ENDS:
                    timings[i].start = timings[i].end - longest
    merge_punctuation(timings)
    index = 0
    for segment in segments:
        n = len([t for t in segment.tokens if t < eot])
        saved = 0
        words: list[WordTiming] = []  # in seconds of the audio, edited below
        while index < len(timings) and saved < n:
            t = timings[index]
            if t.word:
                words.append(
                    WordTiming(t.word, t.tokens, round(offset + t.start, 2), round(offset + t.end, 2), t.probability)
                )
            saved += len(t.tokens)
            index += 1
        if words:
            first, last = words[0], words[-1]
            # the first and second words after a pause may not be longer than twice the median
            if first.end - last_speech > median * 4 and (
                first.end - first.start > longest or (len(words) > 1 and words[1].end - first.start > longest * 2)
            ):
                if len(words) > 1 and words[1].end - words[1].start > longest:
                    boundary = max(words[1].end / 2, words[1].end - longest)
                    first.end = words[1].start = boundary
                first.start = max(0, first.end - longest)
            # the segment's own start and end win over a first or last word that is too long
            if segment.start < first.end and segment.start - 0.5 > first.start:
                first.start = max(0, min(first.end - median, segment.start))
            else:
                segment.start = first.start
            if segment.end > last.start and segment.end + 0.5 < last.end:
                last.end = max(last.start + median, segment.end)
            else:
                segment.end = last.end
            last_speech = segment.end
        segment.words = [Word(w.word, w.start, w.end, round(w.probability, 4), tuple(w.tokens)) for w in words]
