"""Voice-activity detection: Silero VAD (the `silero-vad` package's ONNX model, run by onnxruntime on the CPU,
without torch: `app.server.silero`).

The one VAD of the server: it finds the speech regions of an upload fed in blocks (`SileroVad.finder`, for
`chunking_strategy`; `regions` over samples held whole) and follows a live stream's turns (`SileroVad.stream`,
for realtime sessions). Its knobs are OpenAI's (`VadParams`): `threshold` is Silero's speech probability,
`silence_duration_ms` the silence that ends speech, `prefix_padding_ms` the audio kept before it;
`min_speech_duration_ms` (ours) is the shortest sound that counts as speech.

One ONNX session serves every caller: each call or stream keeps its own recurrent state (`FrameModel`).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app.api.audio import SAMPLE_RATE
from app.api.types import InvalidRequestError
from app.server.silero import WINDOW, FrameModel, RegionRules, SileroModel, TurnTracker, speech_regions

PAUSE_MS = 200  # silence before a pause is reported (between-word gaps are shorter)
FIRST_BLOCK = 313  # frames (10 s) heard before an upload's regions are first looked at


@dataclass(frozen=True)
class VadParams:
    """OpenAI's server-VAD parameters (and the shortest speech), validated when built."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_duration_ms: int = 250

    def __post_init__(self) -> None:
        _check("threshold", self.threshold, 0.0, 1.0)
        _check("prefix_padding_ms", self.prefix_padding_ms, 0, 5000)
        _check("silence_duration_ms", self.silence_duration_ms, 0, 10000)
        _check("min_speech_duration_ms", self.min_speech_duration_ms, 0, 10000)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "min_speech_duration_ms": self.min_speech_duration_ms,
        }


PARAMS = ("threshold", "prefix_padding_ms", "silence_duration_ms", "min_speech_duration_ms")
# OpenAI fields of a `turn_detection` that concern responses, not transcription: accepted and ignored.
IGNORED = ("create_response", "interrupt_response", "idle_timeout_ms")


def server_vad(raw: Any, param: str, current: VadParams | None = None) -> VadParams | None:
    """VAD parameters from an API object `{"type": "server_vad", "threshold": ..., ...}` (a realtime
    `turn_detection` or an upload's `chunking_strategy`), the fields it leaves out as in `current` (default:
    the defaults); None for null. Raises InvalidRequestError naming the field as `param`.<field>."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{param} must be an object or null", param)
    kind = raw.get("type", "server_vad")
    if kind != "server_vad":
        raise InvalidRequestError(f"{param}.type {kind!r} is not supported; use 'server_vad'", f"{param}.type")
    unknown = sorted(set(raw) - {"type", *PARAMS, *IGNORED})
    if unknown:
        raise InvalidRequestError(f"unknown parameter {param}.{unknown[0]}", f"{param}.{unknown[0]}")
    given = {key: raw[key] for key in PARAMS if raw.get(key) is not None}
    try:
        return replace(current or VadParams(), **given)
    except InvalidRequestError as exc:
        field = f"{param}.{exc.param}"
        raise InvalidRequestError(str(exc).replace(str(exc.param), field, 1), field) from exc


def _check(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name)


@dataclass(frozen=True)
class VadEvent:
    """A change of state at `sample` (16-kHz samples since the stream started)."""

    kind: str  # "start" | "stop" | "pause" | "resume"
    sample: int


class RegionSettler:
    """Silero's speech regions (`speech_regions` with `rules`) of a stream whose frame probabilities
    come in blocks, each region given once no later frame can change it. The rules run left to right: after each
    block they rerun over the frames so far, and all but the last two regions are final (the last may still grow,
    be cut or be dropped as too short; the one before it is padded towards the last one's start).
    tests/test_vad.py holds the library to this.

    `grouped`: probabilities are held until at least `FIRST_BLOCK` frames, or a quarter of those heard, have come
    (each rerun goes over all the frames so far: growing blocks keep the reruns' total cost linear)."""

    def __init__(self, rules: RegionRules, *, grouped: bool = True) -> None:
        self.rules = rules
        self.grouped = grouped
        self._probs = array("f")  # float32, as Silero gives them: 4 bytes a frame, not a Python float's 32
        self._pending: list[float] = []
        self._done = 0

    def add(self, probs: list[float]) -> list[tuple[int, int]]:
        """Regions settled by these frames' probabilities."""
        self._pending += probs
        if not self._pending or (self.grouped and len(self._pending) < max(FIRST_BLOCK, len(self._probs) // 4)):
            return []
        return self._settle()

    def _settle(self) -> list[tuple[int, int]]:
        self._probs.extend(self._pending)
        self._pending = []
        found = speech_regions(self._probs.tolist(), len(self._probs) * WINDOW, self.rules)
        settled = found[self._done : -2]
        self._done = max(self._done, len(found) - 2)
        return settled

    def finish(self, length: int) -> list[tuple[int, int]]:
        """The remaining regions, once the stream (`length` samples) has ended."""
        settled = self._settle() if self._pending else []
        if not self._probs:
            return settled
        return settled + speech_regions(self._probs.tolist(), length, self.rules)[self._done :]


def settled_regions(blocks: Iterable[list[float]], rules: RegionRules, length: int) -> Iterator[tuple[int, int]]:
    """`RegionSettler` over frame probabilities in the blocks given (ungrouped), for `length` samples."""
    settler = RegionSettler(rules, grouped=False)
    for block in blocks:
        yield from settler.add(block)
    yield from settler.finish(length)


class FrameProbabilities:
    """Silero's speech probability of each 512-sample frame of a stream fed in blocks of any size (the last frame
    padded with zeros at the end), as `get_speech_timestamps` computes them."""

    def __init__(self, model: FrameModel) -> None:
        self._model = model
        self._rest = np.zeros(0, dtype=np.float32)
        self.samples = 0  # fed so far

    def feed(self, audio: np.ndarray) -> list[float]:
        self.samples += audio.size
        data = np.concatenate([self._rest, audio]) if self._rest.size else audio
        n = data.size // WINDOW
        self._rest = data[n * WINDOW :].copy()
        return self._run(data[: n * WINDOW].reshape(n, WINDOW))

    def finish(self) -> list[float]:
        rest, self._rest = self._rest, np.zeros(0, dtype=np.float32)
        if not rest.size:
            return []
        return self._run(np.pad(rest, (0, WINDOW - rest.size)).reshape(1, WINDOW))

    def _run(self, frames: np.ndarray) -> list[float]:
        return self._model(frames)


class RegionFinder:
    """An upload's speech regions while its audio is fed in blocks (`SileroVad.finder`): each `feed` returns the
    regions that audio settled, `finish` the rest; each region ends within the audio. Blocking (~2.5 ms per second
    of audio). With `speech_rules`, the same probabilities also settle finer regions, gathered in `speech` (where
    a diarized transcript's pieces are cut and kept to)."""

    def __init__(self, model: FrameModel, rules: RegionRules, speech_rules: RegionRules | None = None) -> None:
        self._probabilities = FrameProbabilities(model)
        self._settler = RegionSettler(rules)
        self._speech = RegionSettler(speech_rules) if speech_rules is not None else None
        self.speech: list[tuple[int, int]] = []

    @property
    def samples(self) -> int:
        return self._probabilities.samples

    def feed(self, audio: np.ndarray) -> list[tuple[int, int]]:
        return self._settled(self._probabilities.feed(audio))

    def finish(self) -> list[tuple[int, int]]:
        tail = self._settled(self._probabilities.finish())
        if self._speech is not None:
            self.speech += self._within(self._speech.finish(self.samples))
        return tail + self._within(self._settler.finish(self.samples))

    def _settled(self, probs: list[float]) -> list[tuple[int, int]]:
        if self._speech is not None:
            self.speech += self._within(self._speech.add(probs))
        return self._within(self._settler.add(probs))

    def _within(self, regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(start, min(end, self.samples)) for start, end in regions]


def _rules(params: VadParams, max_seconds: float) -> RegionRules:
    return RegionRules(
        threshold=params.threshold,
        min_speech_duration_ms=params.min_speech_duration_ms,
        min_silence_duration_ms=params.silence_duration_ms,
        speech_pad_ms=params.prefix_padding_ms,
        max_speech_duration_s=max_seconds,
    )


class SileroVad:
    """The loaded Silero model; thread-safe (each use keeps its own state)."""

    def __init__(self) -> None:
        self._model: SileroModel | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> SileroVad:
        """Load the model now (else on first use, which then waits for it)."""
        with self._lock:
            if self._model is None:
                self._model = SileroModel()
        return self

    def frames(self) -> FrameModel:
        """A stream of frames of its own: the shared ONNX session, a new recurrent state."""
        model = self.load()._model
        assert model is not None
        return model.frames()

    def regions(self, audio: np.ndarray, params: VadParams, max_seconds: float = float("inf")) -> list[tuple[int, int]]:
        """The speech of 16-kHz mono `audio` as [start, end) sample ranges, each padded by `prefix_padding_ms`
        on both sides and at most `max_seconds` long with its padding (a longer stretch is cut at its longest
        pause): Silero's `get_speech_timestamps`. Blocking (~2.5 ms per second of audio): run it off the event
        loop."""
        return list(self.regions_as_found(audio, params, max_seconds))

    def regions_as_found(
        self, audio: np.ndarray, params: VadParams, max_seconds: float = float("inf")
    ) -> Iterator[tuple[int, int]]:
        """`regions`, each yielded as soon as the audio after it can no longer change it, so that a long
        upload's first chunks are decoded while the VAD still listens to the rest. Blocking per step."""
        finder = self.finder(params, max_seconds)
        for start in range(0, audio.size, FIRST_BLOCK * WINDOW):
            yield from finder.feed(audio[start : start + FIRST_BLOCK * WINDOW])
        yield from finder.finish()

    def finder(
        self, params: VadParams, max_seconds: float = float("inf"), speech: VadParams | None = None
    ) -> RegionFinder:
        """A `RegionFinder` with these parameters (regions at most `max_seconds` long, see `regions`), and with
        `speech`, finer regions by those parameters too."""
        fine = _rules(speech, float("inf")) if speech is not None else None
        return RegionFinder(self.frames(), _rules(params, max_seconds), fine)

    def stream(self, params: VadParams) -> SpeechStream:
        return SpeechStream(self, params)


class SpeechStream:
    """Turn detection over a live stream: feed 16-kHz audio in chunks of any size, get speech starts and stops.

    A start is reported once the speech has lasted `min_speech_duration_ms` (at the frame where it began); a stop when
    `silence_duration_ms` of silence followed it (at the frame where the silence began). In between, a pause once
    the silence has lasted `PAUSE_MS` (at most half `silence_duration_ms`), at the sample a stop would report,
    and a resume if the speech goes on before the stop: a caller can start on the utterance's final
    transcription at the pause, the rest of `silence_duration_ms` early (shorter gaps, between words, are no
    pauses: each would cost a transcription).
    Padding is the caller's: `prefix_padding_ms` is in `params` for it."""

    def __init__(self, vad: SileroVad, params: VadParams) -> None:
        self.params = params
        self._model = vad.frames()
        self._turns = TurnTracker(params.threshold, params.silence_duration_ms)
        self._rest = np.zeros(0, dtype=np.float32)
        self._position = 0  # samples consumed into whole frames
        self._pending: int | None = None  # a start not yet long enough to report
        self.speaking = False
        self.paused = False  # speaking, and silent since a pause
        self.pause_after = min(PAUSE_MS, params.silence_duration_ms // 2) * SAMPLE_RATE // 1000

    def feed(self, audio: np.ndarray) -> list[VadEvent]:
        data = np.concatenate([self._rest, audio.astype(np.float32, copy=False)])
        n = data.size // WINDOW
        self._rest = data[n * WINDOW :]
        events: list[VadEvent] = []
        min_speech = self.params.min_speech_duration_ms * SAMPLE_RATE // 1000
        for prob in self._model(data[: n * WINDOW].reshape(n, WINDOW)):
            self._position += WINDOW
            change = self._turns.step(prob)
            if change is not None and change[0] == "start":
                self._pending = change[1]
            elif change is not None:
                if self.speaking:
                    events.append(VadEvent("stop", max(change[1], 0)))
                self._pending, self.speaking = None, False
            if self._pending is not None and self._position - self._pending >= min_speech:
                events.append(VadEvent("start", self._pending))
                self._pending, self.speaking = None, True
            # The tracker marks where the silence began until it ends the speech there or hears speech again; the
            # stop it would report is that sample less one frame.
            silent_since = self._turns.silent_since
            paused = self.speaking and silent_since > 0 and self._position - silent_since >= self.pause_after
            if paused and not self.paused:
                events.append(VadEvent("pause", max(silent_since - WINDOW, 0)))
            elif self.paused and not paused and self.speaking:
                events.append(VadEvent("resume", self._position))
            self.paused = paused
        return events

    def end_turn(self) -> None:
        """The caller ended the turn during a pause (before `silence_duration_ms`): the silence goes on as no
        speech, and the next speech is a new start."""
        self._turns.end_turn()
        self._pending, self.speaking, self.paused = None, False, False
