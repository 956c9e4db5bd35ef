"""Levels under `chunking_strategy=auto`: what the VAD hears, and a chunk's quiet voices brought up towards its
loudest.

The VAD (Silero) misses speech far quieter than the audio around it, so it listens to the upload levelled locally
(`LocalLoudness`): each 32-ms frame brought towards -20 dBFS by the loud frames within `WINDOW_S` of it (at most
+40 dB, never turned down). Silence stays silence; a recording quiet throughout is raised as a whole.

Whisper hears a 30-s window as a log-mel spectrum cut off 80 dB below the window's loudest bin. A voice far
quieter than another in the same window (a distant speaker, a quiet recording joined to a loud one) lies near
that floor, and Whisper often leaves it out altogether: on `bench-audio`'s 10-minute file, whose FLEURS clips lie
25-45 dB below its other readers, whole clips were missing from the transcript.

Each speech region of a chunk (the VAD's fine regions: `SPEECH_VAD`) whose level (the 95th percentile of its 32-ms
RMS) lies more than `HEADROOM_DB` below the chunk's loudest region is raised to `HEADROOM_DB` below it, by at most
`MAX_GAIN`; across the pause between two regions the gain moves in a straight line from one to the other. A chunk
whose speech lies within `HEADROOM_DB` of its loudest is left as it is, bit for bit.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from app.api.audio import SAMPLE_RATE, frame_rms
from app.server.serving.chunking import Chunk

FRAME = 512  # 32 ms
HEADROOM_DB = 10.0
MAX_GAIN = 100.0  # +40 dB
TARGET_LEVEL = 0.1  # what the VAD hears: loud frames brought to about -20 dBFS ...
WINDOW_S = 1.0  # ... the loud frames (95th percentile of the 32-ms RMS) within this many seconds of each frame
_REACH = round(WINDOW_S * SAMPLE_RATE / FRAME)  # frames on each side
_RANK = round(0.95 * 2 * _REACH)  # a window's loud frames: its 95th percentile (of 2 * _REACH + 1 frames)


def _frame_levels(samples: np.ndarray) -> np.ndarray:
    """The RMS of each whole 32-ms frame of `samples`."""
    return frame_rms(samples, FRAME)


def _gains(levels: np.ndarray, first: int, count: int) -> np.ndarray:
    """The gains of frames first..first+count-1 of `levels`, each from the frames within `_REACH` of it."""
    if count == 0:
        return np.zeros(0)
    padded = np.concatenate([np.zeros(_REACH), levels, np.zeros(_REACH)])  # silence before and after the audio
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * _REACH + 1)[first : first + count]
    local = np.partition(windows, _RANK, axis=1)[:, _RANK]
    with np.errstate(divide="ignore"):
        return np.where(local > 0, np.clip(TARGET_LEVEL / local, 1.0, MAX_GAIN), 1.0)


class LocalLoudness:
    """Audio fed in blocks of any size comes out levelled for the VAD (the module doc), the same samples however
    it is cut: each frame waits for the `WINDOW_S` after it. Holds that much audio and its frames' levels."""

    def __init__(self) -> None:
        self._held = np.zeros(0, np.float32)  # received, not yet given back (from a frame's start)
        self._levels = np.zeros(0)  # the levels of the `_before` frames given back last, then of the held frames
        self._before = 0

    def feed(self, audio: np.ndarray) -> np.ndarray:
        """The levelled audio that `audio` completes (the frames whose windows are now whole)."""
        self._held = np.concatenate([self._held, audio]) if self._held.size else audio
        measured = len(self._levels) - self._before  # held frames already measured
        self._levels = np.concatenate([self._levels, _frame_levels(self._held[measured * FRAME :])])
        return self._give(max(len(self._levels) - self._before - _REACH, 0))

    def finish(self) -> np.ndarray:
        """The rest: the last frames' windows end with the audio; a last partial frame takes the last gain."""
        return self._give(len(self._levels) - self._before, tail=True)

    def _give(self, frames: int, tail: bool = False) -> np.ndarray:
        gains = _gains(self._levels, self._before, frames).astype(np.float32)
        size = self._held.size if tail else frames * FRAME
        out = self._held[:size]
        if np.any(gains != 1.0):
            envelope = np.repeat(gains, FRAME)
            if size > envelope.size:  # the last partial frame
                envelope = np.concatenate([envelope, np.full(size - envelope.size, gains[-1], np.float32)])
            out = np.clip(out * envelope, -1.0, 1.0)
        self._held = self._held[size:]
        keep = min(_REACH, self._before + frames)
        self._levels = self._levels[self._before + frames - keep :]
        self._before = keep
        return out


def normalized(audio: np.ndarray) -> np.ndarray:
    """`audio` as the VAD hears it under `chunking_strategy=auto` (`LocalLoudness`)."""
    loudness = LocalLoudness()
    return np.concatenate([loudness.feed(audio), loudness.finish()])


def level(samples: np.ndarray) -> float:
    """The level of speech: the 95th percentile of its 32-ms RMS (the whole of a shorter piece)."""
    if samples.size < FRAME:
        return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64)))) if samples.size else 0.0
    return float(np.percentile(_frame_levels(samples), 95))


def regions_in(chunk: Chunk, speech: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The speech regions (samples of the upload, in order) that lie in the chunk's pieces, as samples of the
    chunk's audio (its pieces joined)."""
    starts = [start for start, _ in speech]
    out: list[tuple[int, int]] = []
    offset = 0
    for start, end in chunk.pieces:
        k = max(bisect.bisect_right(starts, start) - 1, 0)
        while k < len(speech) and speech[k][0] < end:
            a, b = max(speech[k][0], start), min(speech[k][1], end)
            if b > a:
                out.append((offset + a - start, offset + b - start))
            k += 1
        offset += end - start
    return out


def leveled(samples: np.ndarray, regions: Sequence[tuple[int, int]]) -> np.ndarray:
    """A chunk's audio with each speech region ([start, end) samples of it, in order) raised to within
    `HEADROOM_DB` of the loudest; the same array where none needs it.

    samples: [N] float32 in [-1, 1]."""
    levels = [level(samples[a:b]) for a, b in regions]
    loudest = max(levels, default=0.0)
    floor = loudest * 10 ** (-HEADROOM_DB / 20)
    gains = [min(MAX_GAIN, floor / x) if 0 < x < floor else 1.0 for x in levels]
    if all(g == 1.0 for g in gains):
        return samples
    envelope = np.interp(
        np.arange(samples.size, dtype=np.float64),
        [t for a, b in regions for t in (a, b - 1)],
        [g for g in gains for _ in (0, 1)],
    )
    return np.clip(samples * envelope, -1.0, 1.0).astype(np.float32)
