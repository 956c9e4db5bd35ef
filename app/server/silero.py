"""Silero VAD without torch: the `silero-vad` wheel's ONNX model run by onnxruntime, and the package's rules that
turn its frame probabilities into speech regions and live turns, over numpy arrays and Python floats.

The package imports torch as it loads (~200 MB and ~1.7 s in the web process, which runs no model of its own);
this module only reads its model files. It runs the wheel's "sequence" export of the model, which takes many
frames in one call (the stock export takes one: a call per 32 ms of audio, whose overhead was most of the cost)
and gives the same probabilities, bit for bit. Each piece gives exactly what the package's does (`OnnxWrapper`,
`get_speech_timestamps_from_probs`, `VADIterator`) at 16 kHz with the package's defaults for the knobs the server
does not set: tests/test_vad.py holds them equal on real audio and on any probabilities.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.api.audio import SAMPLE_RATE

WINDOW = 512  # samples per frame at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous frame the model hears before each frame
MODEL_FILE = "silero_vad_16k_sequence.onnx"  # frames (N x (CONTEXT + WINDOW)) and the LSTM's state -> N probabilities
MAX_FRAMES = 512  # frames per call (16 s): the package's default for this model


def model_path() -> Path:
    """The ONNX model in the installed `silero-vad` package, found without importing it."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed: the server's VAD reads its ONNX model")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / MODEL_FILE


class SileroModel:
    """The loaded ONNX session, shared by every stream (onnxruntime's `run` is thread-safe); one thread per call, as
    the package sets it."""

    def __init__(self, path: Path | None = None) -> None:
        # onnxruntime's official Linux builds report usage to Microsoft (and leave a `.ses` file in the temporary
        # folder) unless this is set before it starts: a transcription server sends nothing.
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(
            str(path or model_path()), sess_options=options, providers=["CPUExecutionProvider"]
        )

    def frames(self) -> FrameModel:
        """A stream of frames of its own (a fresh recurrent state and context) over this session."""
        return FrameModel(self.session)


class FrameModel:
    """Silero's speech probability of each 512-sample frame of one stream, in order: the LSTM's state (h and c,
    1 x 1 x 128 each) and the last `CONTEXT` samples carry from each frame to the next."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)

    def __call__(self, frames: np.ndarray) -> list[float]:
        """`frames`: (N, WINDOW) float32 samples, the stream's next -> the probability that each is speech."""
        probs: list[float] = []
        for first in range(0, len(frames), MAX_FRAMES):
            block = frames[first : first + MAX_FRAMES].astype(np.float32, copy=False)
            contexts = np.empty((len(block), CONTEXT), dtype=np.float32)
            contexts[0] = self._context
            contexts[1:] = block[:-1, -CONTEXT:]
            self._context = block[-1, -CONTEXT:].copy()
            x = np.concatenate([contexts, block], axis=1)
            out, self._h, self._c = self._session.run(None, {"input": x, "h": self._h, "c": self._c})
            probs += out.reshape(-1).tolist()
        return probs


@dataclass(frozen=True)
class RegionRules:
    """`get_speech_timestamps`' knobs at 16 kHz (the others keep the package's defaults: the negative threshold
    0.15 under `threshold`, a long stretch cut at its longest silence of over 98 ms)."""

    threshold: float = 0.5
    min_speech_duration_ms: int = 250
    min_silence_duration_ms: int = 100
    speech_pad_ms: int = 30
    max_speech_duration_s: float = float("inf")


def speech_regions(probs: list[float], length: int, rules: RegionRules) -> list[tuple[int, int]]:
    """The speech of a stream of `length` samples whose frames have these probabilities, as padded [start, end)
    sample ranges: the package's `get_speech_timestamps_from_probs`."""
    min_speech = SAMPLE_RATE * rules.min_speech_duration_ms / 1000
    pad = SAMPLE_RATE * rules.speech_pad_ms / 1000
    max_speech = SAMPLE_RATE * rules.max_speech_duration_s - WINDOW - 2 * pad
    min_silence = SAMPLE_RATE * rules.min_silence_duration_ms / 1000
    min_silence_at_cut = SAMPLE_RATE * 98 / 1000
    negative = max(rules.threshold - 0.15, 0.01)

    speeches: list[list[int]] = []  # [start, end] in samples
    start: int | None = None  # of the speech being heard (None: none)
    silent_since = 0  # where the silence within the speech began (0: none)
    silences: list[tuple[int, int]] = []  # (start, duration) of the silences within the speech so far
    for i, prob in enumerate(probs):
        sample = WINDOW * i
        if prob >= rules.threshold and silent_since:
            if sample - silent_since > min_silence_at_cut:
                silences.append((silent_since, sample - silent_since))
            silent_since = 0
        if prob >= rules.threshold and start is None:
            start = sample
            continue
        if start is not None and sample - start > max_speech:  # too long: cut at its longest silence
            silent_since = 0
            if not silences:  # none: cut here
                speeches.append([start, sample])
                start, silences = None, []
                continue
            cut, duration = max(silences, key=lambda s: s[1])
            speeches.append([start, cut])
            start = cut + duration if cut + duration < cut + sample else None  # the package's test, as it is
            silences = []
        if prob < negative and start is not None:
            silent_since = silent_since or sample
            if sample - silent_since < min_silence:
                continue
            if silent_since - start > min_speech:
                speeches.append([start, silent_since])
            start, silent_since, silences = None, 0, []
    if start is not None and length - start > min_speech:
        speeches.append([start, length])
    return _padded(speeches, pad, length)


def _padded(speeches: list[list[int]], pad: float, length: int) -> list[tuple[int, int]]:
    """Each region widened by `pad` on both sides, or by half the silence between two closer than twice that."""
    for i, speech in enumerate(speeches):
        if i == 0:
            speech[0] = int(max(0, speech[0] - pad))
        if i == len(speeches) - 1:
            speech[1] = int(min(length, speech[1] + pad))
            continue
        after = speeches[i + 1]
        silence = after[0] - speech[1]
        if silence < 2 * pad:
            speech[1] += int(silence // 2)
            after[0] = int(max(0, after[0] - silence // 2))
        else:
            speech[1] = int(min(length, speech[1] + pad))
            after[0] = int(max(0, after[0] - pad))
    return [(start, end) for start, end in speeches]


class TurnTracker:
    """A live stream's speech starts and ends, frame by frame: the package's `VADIterator` without padding. A start
    is the first speech frame's first sample; an end, once `min_silence_ms` of frames under `threshold - 0.15`
    followed, the sample before the silence's first frame began, less a frame."""

    def __init__(self, threshold: float, min_silence_ms: int) -> None:
        self.threshold = threshold
        self.min_silence = SAMPLE_RATE * min_silence_ms / 1000
        self.triggered = False
        self.silent_since = 0  # where the silence within the speech began (0: none), in samples
        self._position = 0  # samples heard

    def step(self, prob: float) -> tuple[str, int] | None:
        """The next frame's probability -> ("start" | "end", sample), or None."""
        self._position += WINDOW
        if prob >= self.threshold and self.silent_since:
            self.silent_since = 0
        if prob >= self.threshold and not self.triggered:
            self.triggered = True
            return "start", max(0, self._position - WINDOW)
        if prob < self.threshold - 0.15 and self.triggered:
            self.silent_since = self.silent_since or self._position
            if self._position - self.silent_since < self.min_silence:
                return None
            end, self.silent_since, self.triggered = self.silent_since - WINDOW, 0, False
            return "end", end
        return None

    def end_turn(self) -> None:
        """Forget the speech heard: the next speech frame is a new start."""
        self.triggered, self.silent_since = False, 0
