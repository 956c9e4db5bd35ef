"""Where voice prints are taken: windows over the speech of a clip, and the stretch of time each one speaks for.

A clip's speech comes as pieces (the VAD's regions, in order, [start, end) samples). Each piece is covered by
windows of the embedder's length every `hop` samples, the last one flush with the piece's end; a piece shorter
than a window is one window of its own length. No window crosses from one piece into the next: the speaker may
change across the pause between them. A window speaks for the time nearer its centre than its neighbours'
(`spans`), so that its speaker can be given to the words said then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HOP_S = 0.5  # a print every half second of speech: turn changes land within a quarter second of it


@dataclass(frozen=True)
class Window:
    """[start, end) samples of the clip, in the piece `piece`."""

    start: int
    end: int
    piece: int

    @property
    def centre(self) -> float:
        return (self.start + self.end) / 2


def plan(pieces: Sequence[tuple[int, int]], size: int, hop: int) -> list[Window]:
    """The windows over these pieces, in order."""
    if size <= 0 or hop <= 0:
        raise ValueError("window size and hop must be positive")
    windows: list[Window] = []
    for k, (start, end) in enumerate(pieces):
        if end <= start:
            continue
        if end - start <= size:
            windows.append(Window(start, end, k))
            continue
        starts = list(range(start, end - size, hop))
        if starts[-1] + size < end:
            starts.append(end - size)
        windows += [Window(s, s + size, k) for s in starts]
    return windows


def spans(windows: Sequence[Window], pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [start, end) samples each window speaks for: from the midpoint between its centre and the previous
    window's in its piece (else its piece's start) to the midpoint with the next's (else its piece's end)."""
    out: list[tuple[int, int]] = []
    for i, w in enumerate(windows):
        before = windows[i - 1] if i > 0 and windows[i - 1].piece == w.piece else None
        after = windows[i + 1] if i + 1 < len(windows) and windows[i + 1].piece == w.piece else None
        start = round((before.centre + w.centre) / 2) if before else pieces[w.piece][0]
        end = round((w.centre + after.centre) / 2) if after else pieces[w.piece][1]
        out.append((start, end))
    return out


def cut(audio: np.ndarray, windows: Sequence[Window]) -> list[np.ndarray]:
    """The windows' samples."""
    return [audio[w.start : w.end] for w in windows]


def same_lengths(windows: Sequence[np.ndarray]) -> list[list[int]]:
    """The windows' indices grouped by length, so that each group can run as one batch."""
    groups: dict[int, list[int]] = {}
    for i, window in enumerate(windows):
        groups.setdefault(window.size, []).append(i)
    return list(groups.values())
