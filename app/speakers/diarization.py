"""The serving layer's one call: a transcription's voice prints and segments -> segments with their speakers.

The prints (`Voice`s, from every chunk of an upload, on its timeline) are clustered into speakers; known
speakers' reference prints name the clusters they match; the rest are lettered "A", "B", ... in the order they
first speak. Each word then takes the speaker whose turns it overlaps most, and segments are cut where the
speaker changes (`turns.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from app.api.types import Segment, Voice
from app.speakers import clustering
from app.speakers.turns import SpeakerSegment, SpeakerTimeline, SpeechRegions, diarize, turns

WEAK_S = 1.0  # a print of less speech than this founds no speaker (`clustering.cluster`'s `weak`)


@dataclass(frozen=True)
class SpeakerRequest:
    """What a request asks of diarization: known speakers (names, and their reference prints in the same order)
    and bounds on the number of speakers."""

    names: tuple[str, ...] = ()
    references: tuple[np.ndarray, ...] = field(default=(), compare=False)
    min_speakers: int | None = None
    max_speakers: int | None = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.references):
            raise ValueError("known speakers need a reference each")
        if self.min_speakers is not None and self.max_speakers is not None and self.min_speakers > self.max_speakers:
            raise ValueError("min_speakers is more than max_speakers")


@dataclass(frozen=True)
class Diarization:
    segments: list[SpeakerSegment]  # Whisper's segments cut where the speaker changes
    speakers: list[str]  # in order of first appearance
    timeline: SpeakerTimeline = field(default_factory=lambda: SpeakerTimeline([]))
    names: dict[int, str] = field(default_factory=dict)  # speaker number -> its name

    def speaker_at(self, start: float, end: float) -> str:
        """Who spoke most over [start, end] (the first speaker when nobody is heard)."""
        speaker = self.timeline.speaker_of(start, end)
        if speaker is None:
            return self.speakers[0] if self.speakers else "A"
        return self.names[speaker]


def label_speakers(
    voices: Sequence[Voice],
    segments: Sequence[Segment],
    request: SpeakerRequest,
    speech: Sequence[tuple[float, float]] = (),
    threshold: float = clustering.THRESHOLD,
    known_similarity: float = clustering.KNOWN_SIMILARITY,
) -> Diarization:
    """Who said each piece of these segments, from the voice prints taken over the same audio; `speech`: where
    the VAD heard speech (s), which the pieces are cut at and kept to."""
    regions = SpeechRegions(speech)
    voices = sorted(voices, key=lambda v: v.start)
    if not voices:  # no speech heard: one speaker, the first known one if any
        pieces = diarize(segments, SpeakerTimeline([]), [request.names[0] if request.names else "A"], regions)
        return Diarization(pieces, list(dict.fromkeys(p.speaker for p in pieces)))
    vectors = np.stack([np.asarray(v.vector, np.float32) for v in voices])
    weak = np.array([v.heard < WEAK_S for v in voices])
    labels = clustering.cluster(vectors, threshold, request.min_speakers, request.max_speakers, weak)
    count = int(labels.max()) + 1
    references = np.stack(request.references) if request.references else np.zeros((0, vectors.shape[1]))
    known = clustering.match_known(clustering.centroids(vectors, labels), references, known_similarity)
    timeline = SpeakerTimeline(turns([(v.start, v.end) for v in voices], labels.tolist()))
    numbered = diarize(segments, timeline, [str(k) for k in range(count)], regions)
    order = [int(s) for s in dict.fromkeys(p.speaker for p in numbered)]  # as they first speak in the text
    order += [k for k in range(count) if k not in order]
    lettered = clustering.names(count, {order.index(k): j for k, j in known.items()}, request.names)
    name = {k: lettered[order.index(k)] for k in range(count)}
    pieces = [dataclasses.replace(p, speaker=name[int(p.speaker)]) for p in numbered]
    return Diarization(pieces, list(dict.fromkeys(p.speaker for p in pieces)), timeline, name)
