"""The speaker embedder's contract, and the one the operator chose.

A `SpeakerEmbedder` turns windows of speech into voice prints: unit vectors that lie close together for the same
voice. `prints` takes a clip and its speech pieces and gives a `Voice` per window: the time it speaks for and its
vector. `load_embedder` gives the default (GE2E, its weights from the `resemblyzer` wheel) or an ONNX file the
operator names (`SPECWHISPER_SPEAKER_EMBEDDER`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from app.api.types import Voice
from app.speakers import windows as plan
from app.speakers.clustering import unit_mean

SAMPLE_RATE = 16000


class SpeakerEmbedder(Protocol):
    name: str
    dim: int
    window_s: float  # the speech each print hears (a shorter piece of speech is heard whole)

    def embed(self, windows: list[np.ndarray]) -> np.ndarray:
        """Windows of 16-kHz float32 audio (any lengths) -> [len(windows), dim] float32 unit vectors."""
        ...


def load_embedder(path: str | Path | None = None) -> SpeakerEmbedder:
    """The GE2E encoder (`path` None) or the ONNX embedder in `path`; FileNotFoundError/ValueError if unusable."""
    if path is None or str(path) == "":
        from app.speakers.ge2e import Ge2eEmbedder

        return Ge2eEmbedder.load()
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"a speaker embedder file must be an ONNX model (.onnx): {path}")
    from app.speakers.onnx import OnnxEmbedder

    return OnnxEmbedder.load(path)


def prints(
    embedder: SpeakerEmbedder, audio: np.ndarray, pieces: Sequence[tuple[int, int]], hop_s: float = plan.HOP_S
) -> list[Voice]:
    """A voice print per window over the clip's speech `pieces` ([start, end) samples), with the time (s of the
    clip) each speaks for."""
    size, hop = round(embedder.window_s * SAMPLE_RATE), round(hop_s * SAMPLE_RATE)
    windows = plan.plan(pieces, size, hop)
    if not windows:
        return []
    vectors = embedder.embed(plan.cut(audio, windows))
    return [
        Voice(start / SAMPLE_RATE, end / SAMPLE_RATE, vector, (w.end - w.start) / SAMPLE_RATE)
        for w, (start, end), vector in zip(windows, plan.spans(windows, pieces), vectors, strict=True)
    ]


def reference_print(embedder: SpeakerEmbedder, audio: np.ndarray, hop_s: float = plan.HOP_S) -> np.ndarray:
    """A known speaker's print: the mean of its reference's window prints, to unit length (as GE2E's utterance
    embedding is made)."""
    vectors = np.stack([v.vector for v in prints(embedder, audio, [(0, audio.size)], hop_s)])
    return unit_mean(vectors)
