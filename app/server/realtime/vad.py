"""Server-side voice activity detection: frame energy against a tracked noise floor.

Dependency-free and cheap enough to run on every appended chunk in the event loop. Speech
starts after `min_speech_ms` of loud frames and stops after `silence_duration_ms` of quiet
ones; `threshold` (0..1, OpenAI's knob) sets how far above the noise floor a frame must be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_MS = 20
FLOOR_DB = -90.0  # digital silence is clamped here
MIN_SPEECH_DB = -55.0  # nothing quieter than this is speech, whatever the floor


@dataclass(frozen=True)
class VadConfig:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_ms: int = 60

    @property
    def margin_db(self) -> float:
        """Loudness above the noise floor that counts as speech: 6 dB at threshold 0, 18 dB at 1."""
        return 6.0 + 12.0 * self.threshold


@dataclass(frozen=True)
class VadEvent:
    """A change of state at `sample` (16-kHz samples since the stream started)."""

    kind: str  # "start" | "stop"
    sample: int


class EnergyVad:
    """Feeds on 16-kHz float audio in chunks of any size; reports speech starts and stops."""

    def __init__(self, config: VadConfig, sample_rate: int = 16000) -> None:
        self.config = config
        self.frame = sample_rate * FRAME_MS // 1000
        self._rest = np.zeros(0, dtype=np.float32)
        self._position = 0  # samples consumed into whole frames
        self.floor_db = -60.0
        self.speaking = False
        self._loud_run = 0  # consecutive loud frames
        self._quiet_run = 0  # consecutive quiet frames while speaking
        self.last_speech_end = 0

    def _frames(self, ms: int) -> int:
        return max(1, ms // FRAME_MS)

    def _is_speech(self, db: float) -> bool:
        loud = db > max(MIN_SPEECH_DB, self.floor_db + self.config.margin_db)
        # The floor falls at once to quieter frames and rises slowly through loud ones.
        self.floor_db = db if db < self.floor_db else self.floor_db + (0.002 if loud else 0.05) * (db - self.floor_db)
        return loud

    def feed(self, audio: np.ndarray) -> list[VadEvent]:
        data = np.concatenate([self._rest, audio.astype(np.float32, copy=False)])
        n = data.size // self.frame
        self._rest = data[n * self.frame :]
        if n == 0:
            return []
        frames = data[: n * self.frame].reshape(n, self.frame)
        rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
        levels = np.maximum(20 * np.log10(np.maximum(rms, 1e-12)), FLOOR_DB)
        events: list[VadEvent] = []
        for db in levels:
            start = self._position
            self._position += self.frame
            if self._is_speech(float(db)):
                self._loud_run += 1
                self._quiet_run = 0
                self.last_speech_end = self._position
                if not self.speaking and self._loud_run >= self._frames(self.config.min_speech_ms):
                    self.speaking = True
                    events.append(VadEvent("start", start - (self._loud_run - 1) * self.frame))
            else:
                self._loud_run = 0
                if self.speaking:
                    self._quiet_run += 1
                    if self._quiet_run >= self._frames(self.config.silence_duration_ms):
                        self.speaking = False
                        self._quiet_run = 0
                        events.append(VadEvent("stop", self._position))
        return events
