"""Where in a VAD speech region the voice is: each region's ends moved to its voice, and its pauses cut out.

A diarized piece covers the speech region it was heard in (`turns.SpeechRegions.spread`), and the regions are
Silero's, which are late at both ends: its speech probability falls 0.1-0.2 s after a voice stops (each region
carries 30 ms of padding too), and it rises late on a voice that starts softly (FLEURS's readers: up to 0.7 s).
So, on each region's 10-ms frames, against its loud ones (its `LOUD_PERCENTILE`th percentile):
- its first and last frames more than `EDGE_DB` below are left out, up to `MAX_TRIM_S` at each end;
- an end that is in voice instead takes in the voice next to it: the frames within `EDGE_DB`, up to
  `MAX_GROW_S`, never past the next region or a seam where the chunk's pieces meet;
- a pause inside it (frames `PAUSE_DB` below for `MIN_PAUSE_S` or more) cuts it in two: Silero, waiting for
  300 ms of silence that its late fall shortens, keeps a reader's pauses between sentences inside one region.

`bench-audio --part diarization` (2026-12-07; DER of the 2-, 3- and 4-voice conversations):
- the ends left out: false alarm 5.4 / 8.5 / 9.4% -> 4.0 / 5.0 / 6.4%, DER 7.5 / 14.0 / 15.2% -> 6.1 / 10.8 /
  12.4%, missed speech up 0.1-0.3 points (35 dB below removed 40% as much false alarm as 25 dB, and 20 dB little
  more while missing more speech);
- scored against a reference whose pauses of exactly 0.3 s (where a voice's clips meet) no longer count as
  speech at some offsets and not at others, the pauses cut out: DER 9.4 / 11.4 / 13.6% -> 4.0 / 9.0 / 9.5%,
  speech named right 97.8 / 95.0 / 94.1%; the ends grown as well: 3.9 / 8.3 / 8.4%, named right 97.9 / 95.8 /
  95.2%. Pauses of 0.25 s cut into a reader's soft commas (the 3-voice conversation named right 94.7%), of
  0.3 s left most pauses whole (DER 7.4 / 10.9 / 11.9%).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.api.audio import SAMPLE_RATE, frame_rms

FRAME = SAMPLE_RATE // 100  # 10 ms
EDGE_DB = 25.0
LOUD_PERCENTILE = 95
MAX_TRIM_S = 0.3
MAX_TRIM_FRAMES = round(MAX_TRIM_S * SAMPLE_RATE / FRAME)
MIN_FRAMES = 10  # a region shorter than 100 ms is kept whole
PAUSE_DB = 35.0  # a region is cut where its frames stay this far below its loud ones ...
MIN_PAUSE_S = 0.28  # ... for this long (a pause of ~0.3 s, the reference's, less the soft ends around it)
MIN_PAUSE_FRAMES = round(MIN_PAUSE_S * SAMPLE_RATE / FRAME)
MAX_GROW_S = 0.4  # a region starting or ending in voice takes in the voice next to it, up to this much
MAX_GROW_FRAMES = round(MAX_GROW_S * SAMPLE_RATE / FRAME)


def frame_levels(samples: np.ndarray) -> np.ndarray:
    """[N] float32 samples -> [N // FRAME] the mean power of each whole 10-ms frame, in dB."""
    return 10 * np.log10(np.square(frame_rms(samples, FRAME)) + 1e-12)  # type: ignore[no-any-return]


def _leading(mask: np.ndarray, most: int) -> int:
    """How many of `mask`'s leading frames are set (quiet ones at a trimmed end, voiced ones where an end grows),
    at most `most`."""
    unset = np.flatnonzero(~mask[:most])
    return int(unset[0]) if unset.size else min(most, mask.size)


def _pauses(quiet: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) frames of each run of at least `MIN_PAUSE_FRAMES` quiet frames with loud ones on both sides."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], quiet, [False]]).astype(np.int8)))
    runs = zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True)
    return [(a, b) for a, b in runs if b - a >= MIN_PAUSE_FRAMES and a > 0 and b < quiet.size]


def _grown(samples: np.ndarray, at: int, limit: int, quiet_below: float) -> int:
    """How many samples of voice lie next to `at`, towards `limit` (before it when `limit` < `at`): whole 10-ms
    frames from `at` on, up to the first quiet one (below `quiet_below` dB), `MAX_GROW_FRAMES` or `limit`."""
    span = min(abs(limit - at), MAX_GROW_FRAMES * FRAME)
    frames = samples[at - span : at][::-1] if limit < at else samples[at : at + span]
    levels = frame_levels(np.ascontiguousarray(frames))
    return _leading(levels >= quiet_below, levels.size) * FRAME


def voiced(samples: np.ndarray, regions: Sequence[tuple[int, int]], seams: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Each speech region ([start, end) samples of `samples`, in order) with its ends moved to the voice: its quiet
    first and last frames left out, or where it starts or ends in voice, the voice next to it taken in (never
    past a neighbour or a `seams` sample, where the audio's pieces meet); and cut in two at each pause inside it
    (the module's rules). A region keeps at least its loud frames; one too short to judge is kept whole.

    samples: [N] float32."""
    out = []
    walls = sorted({0, samples.size, *seams})
    for k, (start, end) in enumerate(regions):
        levels = frame_levels(samples[start:end])
        if levels.size < MIN_FRAMES:
            out.append((start, end))
            continue
        loud = np.percentile(levels, LOUD_PERCENTILE)
        quiet = levels < loud - EDGE_DB
        lead = _leading(quiet, MAX_TRIM_FRAMES)
        trail = _leading(quiet[::-1], MAX_TRIM_FRAMES)  # the loudest frame is never quiet: lead + trail < frames
        last = start + levels.size * FRAME  # the end of the last whole frame: a partial one after it goes with it
        at = start + lead * FRAME
        if lead == 0:
            floor = max([w for w in walls if w <= start] + ([out[-1][1]] if out else []))
            at -= _grown(samples, start, floor, loud - EDGE_DB)
        for a, b in _pauses(levels < loud - PAUSE_DB):
            if start + a * FRAME > at and b < levels.size - trail:
                out.append((at, start + a * FRAME))
                at = start + b * FRAME
        if trail:
            out.append((at, last - trail * FRAME))
        else:
            ceiling = min([w for w in walls if w >= end] + ([regions[k + 1][0]] if k + 1 < len(regions) else []))
            out.append((at, end + _grown(samples, end, ceiling, loud - EDGE_DB)))
    return out
