"""Conversations of several voices, built from the benchmark's real speech, with who spoke when.

Each voice is the clips of one speaker in the benchmark set (LJSpeech's reader, a LibriVox reader, JFK, a FLEURS
speaker, pocketsphinx's card reader), all in English. A conversation alternates its voices at random,
each turn 2-15 s of a voice's speech (cut at the quietest 10 ms near the length drawn) after a pause of
0.2-1 s, or, in an overlapping conversation, starting 0.5-2 s before the previous turn ends (the two mixed).
The reference says where each turn's speech is: its voiced 10-ms frames (judged against the loudest frame and the
noise floor of the recording it comes from), pauses under `PAUSE_S` bridged.
Each voice's last `REFERENCE_S` of audio is kept out of the turns: it is the voice's known-speaker reference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf

from app.tools.manifest import ManifestClip

SR = 16000
REFERENCE_S = 5.0
FRAME = SR // 100  # 10 ms
VOICED_DB = 35.0  # a 10-ms frame within this many dB of its recording's loudest ...
ABOVE_FLOOR_DB = 10.0  # ... and this many above the recording's noise floor is voiced
PAUSE_S = 0.3  # a pause this long within a turn is not speech in the reference (as DIHARD-style references split)
VOICES: dict[str, tuple[str, ...]] = {  # a voice: the manifest ids (prefixes) of its clips
    "lj": ("ljspeech/LJ00",),  # LJSpeech's reader
    "austen": ("pocketsphinx/sense_and_sensibility",),  # a LibriVox reader
    "jfk": ("whisper/jfk",),
    # FLEURS's English clips 001, 005 and 008: one speaker (their prints alike, 0.89-0.95, and unlike the rest)
    "fleurs-en": ("fleurs/fleurs-en-001", "fleurs/fleurs-en-005", "fleurs/fleurs-en-008"),
    "cards": ("pocketsphinx/cards_",),  # pocketsphinx's card names, one speaker
}
# English voices only: Whisper decodes each chunk in one language, and a turn in another language is lost to it
# (an earlier set with FLEURS's German and French speakers measured the transcription's misses, not diarization).
CONVERSATIONS: dict[str, tuple[tuple[str, ...], bool]] = {  # name: its voices, and whether turns overlap
    "2 speakers": (("lj", "austen"), False),
    "3 speakers": (("lj", "jfk", "fleurs-en"), False),
    "4 speakers": (("lj", "austen", "jfk", "fleurs-en"), False),
    "2 speakers, overlapping": (("lj", "fleurs-en"), True),
}


@dataclass(frozen=True)
class Turn:
    """A stretch of one speaker's speech (s of the conversation)."""

    speaker: str
    start: float
    end: float


@dataclass
class Conversation:
    name: str
    audio: np.ndarray
    turns: list[Turn]
    references: dict[str, np.ndarray] = field(default_factory=dict)  # a voice's reference audio, not in the turns

    @property
    def seconds(self) -> float:
        return self.audio.size / SR

    @property
    def speakers(self) -> list[str]:
        return list(dict.fromkeys(t.speaker for t in self.turns))


def _read(clip: ManifestClip) -> np.ndarray:
    audio, rate = sf.read(clip.audio, dtype="float32", always_2d=True)
    if rate != SR:
        raise ValueError(f"{clip.id}: {rate} Hz, not {SR}")
    return audio.mean(axis=1)


def _energy(audio: np.ndarray) -> np.ndarray:
    """dB of each 10 ms."""
    n = audio.size // FRAME
    power = np.square(audio[: n * FRAME].reshape(n, FRAME)).mean(axis=1)
    return 10 * np.log10(power + 1e-10)


def _voiced(audio: np.ndarray) -> np.ndarray:
    """Which samples of a recording are voiced: in 10-ms frames within `VOICED_DB` of its loudest and at least
    `ABOVE_FLOOR_DB` above its noise floor (the 10th percentile frame), so that a noisy recording's pauses (JFK's
    crowd) are not counted as speech."""
    db = _energy(audio)
    mask = np.zeros(audio.size, bool)
    if db.size:
        floor = float(np.percentile(db, 10))
        frames = db > max(float(db.max()) - VOICED_DB, floor + ABOVE_FLOOR_DB)
        mask[: frames.size * FRAME] = np.repeat(frames, FRAME)
    return mask


def _stretches(voiced: np.ndarray, bridge_s: float = PAUSE_S) -> list[tuple[float, float]]:
    """The voiced stretches of a mask (s), pauses shorter than `bridge_s` bridged (counted in samples: a voice's
    clips are joined by exactly `PAUSE_S` of silence, which seconds' rounding would call shorter at some offsets)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[False], voiced, [False]]).astype(np.int8)))
    bridge = round(bridge_s * SR)
    stretches: list[tuple[int, int]] = []
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        if stretches and start - stretches[-1][1] < bridge:
            stretches[-1] = (stretches[-1][0], end)
        else:
            stretches.append((start, end))
    return [(start / SR, end / SR) for start, end in stretches]


class Voice:
    """A speaker's speech, handed out turn by turn (from the start again when used up), with where it is voiced."""

    def __init__(self, name: str, clips: Sequence[ManifestClip]) -> None:
        if not clips:
            raise ValueError(f"no clips in the manifest for the voice {name!r}")
        pieces, masks = [], []
        gap = int(0.3 * SR)
        for clip in clips:
            audio = _read(clip)
            voiced = _voiced(audio)
            at = np.flatnonzero(voiced)
            start, end = (int(at[0]), int(at[-1]) + 1) if at.size else (0, audio.size)
            pieces += [audio[start:end], np.zeros(gap, np.float32)]
            masks += [voiced[start:end], np.zeros(gap, bool)]
        whole, mask = np.concatenate(pieces), np.concatenate(masks)
        keep = int(REFERENCE_S * SR)
        self.name = name
        self.reference = whole[-keep:]
        self.speech, self.voiced = whole[:-keep], mask[:-keep]
        self.cursor = 0

    def turn(self, seconds: float) -> tuple[np.ndarray, np.ndarray]:
        """About `seconds` of its speech, and which of its samples are voiced."""
        if self.cursor >= self.speech.size - 2 * SR:
            self.cursor = 0
        rest = self.speech[self.cursor :]
        want = min(int(seconds * SR), rest.size)
        if want < rest.size:  # end at the quietest 10 ms within half a second of the length drawn
            low, high = max(SR, want - SR // 2), min(rest.size, want + SR // 2)
            db = _energy(rest[low:high])
            want = low + int(np.argmin(db)) * FRAME if db.size else want
        piece, voiced = rest[:want], self.voiced[self.cursor : self.cursor + want]
        self.cursor += want
        return piece, voiced


def voices(clips: Sequence[ManifestClip]) -> dict[str, Voice]:
    return {name: Voice(name, [c for c in clips if c.id.startswith(prefixes)]) for name, prefixes in VOICES.items()}


def build(
    name: str, voice_names: Sequence[str], pool: dict[str, Voice], seconds: float, overlap: bool, seed: int = 0
) -> Conversation:
    """A conversation of about `seconds` among these voices (no voice twice in a row)."""
    rng = random.Random(seed)
    parts: list[tuple[int, np.ndarray, str]] = []  # (start sample, audio, voice)
    turns: list[Turn] = []
    at, previous = int(0.5 * SR), None
    while at < seconds * SR:
        speaker = rng.choice([v for v in voice_names if v != previous])
        audio, voiced = pool[speaker].turn(rng.uniform(2.0, 15.0))
        parts.append((at, audio, speaker))
        turns += [Turn(speaker, round(at / SR + a, 3), round(at / SR + b, 3)) for a, b in _stretches(voiced)]
        end = at + audio.size
        shift = -rng.uniform(0.5, 2.0) if overlap else rng.uniform(0.2, 1.0)
        at, previous = max(end + int(shift * SR), at + SR), speaker
    total = max(start + audio.size for start, audio, _ in parts) + int(0.5 * SR)
    mix = np.zeros(total, np.float32)
    for start, audio, _ in parts:
        mix[start : start + audio.size] += audio
    peak = float(np.abs(mix).max())
    if peak > 0.99:
        mix *= 0.99 / peak
    references = {v: pool[v].reference for v in voice_names}
    return Conversation(name, mix, turns, references)


def standard(clips: Sequence[ManifestClip], seconds: float = 120.0, seed: int = 0) -> list[Conversation]:
    """The benchmark's conversations (`CONVERSATIONS`), each about `seconds` long."""
    out = []
    for k, (name, (names, overlap)) in enumerate(CONVERSATIONS.items()):
        pool = voices(clips)  # each conversation from the start of every voice's speech
        out.append(build(name, names, pool, seconds, overlap, seed + k))
    return out
