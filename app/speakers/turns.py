"""Speakers -> turns -> words: every word gets one speaker, and segments are cut where the speaker changes.

`turns` merges the time each print speaks for into speaker turns (a lone print between two of another voice is
taken for that voice: half a second is too short to be a turn). `speaker_of` gives a stretch of time (a word)
the speaker whose turns overlap it most (WhisperX's rule), else the nearest turn's. `diarize` cuts each of
Whisper's segments between words where the speaker changes, where the VAD heard a pause (`SpeechRegions`: each word
belongs to the region it overlaps most) or after a pause of `PAUSE_S` between words: no segment splits a word, and
the segments' texts are the transcript's. A segment's times are the VAD's where it has them: the pieces of one
speech region cover it, the first from the region's start, the last to its end, and two speakers' pieces meet
halfway between their words (Whisper's word times stretch over the pauses around them, or start late, and speech
it did not write is still someone's); a piece's words outside every region keep their own times; and a region in
which Whisper wrote nothing is taken into the piece of its voice just before or after it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.api.types import Segment, Word

PAUSE_S = 1.0  # a pause this long between two words of one speaker ends a segment too
# A region in which Whisper wrote no word is taken into a piece of its voice less than this far from it. On
# `bench-audio --part diarization`, with the regions' quiet ends left out (`voiced`): at 1.0 s the 3-voice
# conversation's speech named right rose 94.2 -> 95.1%, its DER the same (10.8%), the others unchanged against 0.5 s;
# at 1.5 s, 95.9% but DER 12.0% (regions further away were more often JFK's crowd, which the VAD takes for speech).
# (Before the ends were left out, 1.0 s had cost that conversation's DER 14.0 -> 14.9%.)
CLAIM_GAP_S = 1.0


@dataclass(frozen=True)
class Turn:
    start: float
    end: float
    speaker: int


@dataclass(frozen=True)
class SpeakerSegment:
    """A piece of a segment said by one speaker (OpenAI's `transcript.text.segment`)."""

    start: float
    end: float
    text: str
    speaker: str
    words: tuple[Word, ...] = ()


def turns(spans: Sequence[tuple[float, float]], labels: Sequence[int]) -> list[Turn]:
    """The prints' spans (s, in time order) and speakers -> turns, each the longest run of one speaker's prints
    with no gap between them."""
    labels = list(labels)
    for i in range(1, len(labels) - 1):  # a lone print inside another voice's turn
        contiguous = spans[i - 1][1] >= spans[i][0] and spans[i][1] >= spans[i + 1][0]
        if contiguous and labels[i - 1] == labels[i + 1] != labels[i]:
            labels[i] = labels[i - 1]
    out: list[Turn] = []
    for (start, end), speaker in zip(spans, labels, strict=True):
        if out and out[-1].speaker == speaker and start <= out[-1].end + 1e-6:
            out[-1] = Turn(out[-1].start, max(end, out[-1].end), speaker)
        else:
            out.append(Turn(start, end, speaker))
    return out


class SpeakerTimeline:
    """Turns in time order, asked who spoke over a stretch of time."""

    def __init__(self, turns: Sequence[Turn]) -> None:
        self.turns = sorted(turns, key=lambda t: t.start)
        self._ends = [t.end for t in self.turns]

    def speaker_of(self, start: float, end: float) -> int | None:
        """The speaker whose turns overlap [start, end] most; else the nearest turn's; None without turns."""
        if not self.turns:
            return None
        overlap: dict[int, float] = {}
        k = bisect.bisect_left(self._ends, start)
        while k < len(self.turns) and self.turns[k].start < end:
            t = self.turns[k]
            shared = min(end, t.end) - max(start, t.start)
            if shared > 0:
                overlap[t.speaker] = overlap.get(t.speaker, 0.0) + shared
            k += 1
        if overlap:
            return max(overlap, key=lambda s: overlap[s])
        middle = (start + end) / 2
        return min(self.turns, key=lambda t: max(t.start - middle, middle - t.end)).speaker


class SpeechRegions:
    """Where the VAD heard speech ([start, end) s, in time order, apart by pauses)."""

    def __init__(self, regions: Sequence[tuple[float, float]]) -> None:
        self.regions = sorted(regions)
        # the same lookup as a speaker's: each region labelled with its index
        self._lookup = SpeakerTimeline([Turn(a, b, k) for k, (a, b) in enumerate(self.regions)])

    def region_of(self, start: float, end: float) -> int | None:
        """The region that [start, end] overlaps most, else the nearest; None without regions."""
        return self._lookup.speaker_of(start, end)

    def spread(self, placed: Sequence[tuple[SpeakerSegment, int | None]]) -> list[SpeakerSegment]:
        """Pieces in time order, each with its region (None: outside every one) -> the pieces with the times of the
        speech they were heard in: a region's first piece from its start, its last to its end, and where the
        speaker changes within it, the two pieces meet halfway between their words."""
        out = []
        for k, (piece, region) in enumerate(placed):
            if region is None:
                out.append(piece)
                continue
            start, end = piece.start, piece.end
            before = placed[k - 1] if k > 0 and placed[k - 1][1] == region else None
            after = placed[k + 1] if k + 1 < len(placed) and placed[k + 1][1] == region else None
            if before is None:
                start = min(start, self.regions[region][0])
            elif before[0].speaker != piece.speaker:
                start = min(start, (before[0].end + piece.start) / 2)
            if after is None:
                end = max(end, self.regions[region][1])
            elif after[0].speaker != piece.speaker:
                end = max(end, (piece.end + after[0].start) / 2)
            out.append(dataclasses.replace(piece, start=round(start, 3), end=round(end, 3)))
        return out

    def claimed(
        self, pieces: Sequence[SpeakerSegment], speaker_of: Callable[[float, float], str]
    ) -> list[SpeakerSegment]:
        """Pieces in time order -> the same, each also covering the regions next to it in which Whisper wrote no
        word, where the region's voice is the piece's speaker (`speaker_of`) and the pause between them is
        under `CLAIM_GAP_S`: speech Whisper left out is still its speaker's."""
        out = list(pieces)
        k = 0  # the first piece that ends after the region starts
        for start, end in self.regions:
            while k < len(out) and out[k].end <= start:
                k += 1
            if k < len(out) and out[k].start < end:
                continue  # a piece has words here
            speaker = speaker_of(start, end)
            if k > 0 and out[k - 1].speaker == speaker and start - out[k - 1].end < CLAIM_GAP_S:
                out[k - 1] = dataclasses.replace(out[k - 1], end=round(end, 3))
            elif k < len(out) and out[k].speaker == speaker and out[k].start - end < CLAIM_GAP_S:
                out[k] = dataclasses.replace(out[k], start=round(start, 3))
        return out

    def overlaps(self, region: int, start: float, end: float) -> bool:
        """Whether [start, end] shares some time with the region."""
        a, b = self.regions[region]
        return min(end, b) > max(start, a)

    def within(self, region: int | None, start: float, end: float) -> tuple[float, float]:
        """[start, end] cut to the region, unless it lies outside it."""
        if region is None or not self.overlaps(region, start, end):
            return start, end
        a, b = self.regions[region]
        return max(start, a), min(end, b)


def diarize(
    segments: Sequence[Segment],
    timeline: SpeakerTimeline,
    names: Sequence[str],
    speech: SpeechRegions | None = None,
) -> list[SpeakerSegment]:
    """Whisper's segments cut at speaker changes and pauses between words, each piece with its speaker's name."""
    speech = speech or SpeechRegions([])
    placed: list[tuple[SpeakerSegment, int | None]] = []  # each piece and its speech region
    for segment in segments:
        if not segment.text.strip():
            continue
        if not segment.words:
            speaker = timeline.speaker_of(segment.start, segment.end)
            placed.append(
                (SpeakerSegment(segment.start, segment.end, segment.text.strip(), _name(speaker, names)), None)
            )
            continue
        runs: list[tuple[tuple[int | None, int | None], list[Word]]] = []
        for word in segment.words:
            key = (timeline.speaker_of(word.start, word.end), speech.region_of(word.start, word.end))
            if runs and runs[-1][0] == key and word.start - runs[-1][1][-1].end < PAUSE_S:
                runs[-1][1].append(word)
            else:
                runs.append((key, [word]))
        for (speaker, region), words in runs:
            text = "".join(w.word for w in words).strip()
            start, end = speech.within(region, words[0].start, max(words[-1].end, words[0].start))
            inside = region if region is not None and speech.overlaps(region, start, end) else None
            placed.append((SpeakerSegment(start, end, text, _name(speaker, names), tuple(words)), inside))
    return speech.claimed(speech.spread(placed), lambda a, b: _name(timeline.speaker_of(a, b), names))


def _name(speaker: int | None, names: Sequence[str]) -> str:
    return names[speaker] if speaker is not None and speaker < len(names) else (names[0] if names else "A")
