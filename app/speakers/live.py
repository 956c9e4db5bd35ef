"""A live session's speakers, told apart turn by turn as its turns complete (there is no going back to relabel).

A turn's voice is the mean of its prints. It is the speaker heard so far whose mean voice is nearest, when at
least `similarity` alike (the threshold that names known speakers: a turn's mean is as steady as a reference's);
otherwise a new speaker, lettered "A", "B", ... in the order they first speak. A turn of too little speech to
found a speaker on (a short "yes") goes to the nearest speaker heard so far.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.api.types import Voice
from app.speakers.clustering import KNOWN_SIMILARITY, names, unit_mean
from app.speakers.diarization import WEAK_S


class LiveSpeakers:
    def __init__(self, similarity: float = KNOWN_SIMILARITY) -> None:
        self.similarity = similarity
        self._sums: list[np.ndarray] = []  # each speaker's prints, summed

    @property
    def count(self) -> int:
        return len(self._sums)

    def label(self, voices: Sequence[Voice]) -> str | None:
        """The speaker of a turn with these prints; None when it has none (no speech was printed)."""
        if not voices:
            return None
        vectors = np.stack([np.asarray(v.vector, np.float32) for v in voices])
        heard = sum(v.heard for v in voices)
        voice = unit_mean(vectors)
        if self._sums:
            means = np.stack([s / max(float(np.linalg.norm(s)), 1e-12) for s in self._sums])
            scores = means @ voice
            nearest = int(np.argmax(scores))
            if scores[nearest] >= self.similarity or heard < WEAK_S:
                self._sums[nearest] += vectors.sum(axis=0)
                return names(self.count, {}, [])[nearest]
        self._sums.append(vectors.sum(axis=0))
        return names(self.count, {}, [])[-1]
