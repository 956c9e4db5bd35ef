"""Would a noise suppressor help? The measurement behind the Realtime API's `noise_reduction` being a no-op.

`python -m app bench-audio --part noise-reduction` puts two well-kept suppressors in front of our server and
its turn detection, on the benchdata speech under generated noise:

* RNNoise (Xiph's recurrent suppressor for voice calls, through `pyrnnoise`; streaming, 48 kHz frames), and
* spectral gating (`noisereduce`, stationary: the noise profile is learnt from the whole clip).

It reports the WER of ours on each condition with and without each suppressor (the suppressor filtering what
the model hears), and, for turn detection (Silero VAD at OpenAI's defaults, fed in 20-ms chunks as a live
session is), the false speech starts per minute on noise alone and the turns found in speech separated by
2-s gaps under noise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import soxr
from tqdm import tqdm

from app.api.audio import SAMPLE_RATE, load_audio
from app.server.vad import SileroVad, VadParams
from app.tools.bench import error_rate
from app.tools.manifest import ManifestClip, read_manifest
from app.tools.process import ServerProcess
from app.tools.realaudio import Ours, music

SR = SAMPLE_RATE
RNNOISE_RATE = 48000
Audio = np.ndarray


def rnnoise(audio: Audio) -> Audio:
    """RNNoise over a whole stream, frame by frame, as a live session would run it."""
    from pyrnnoise import rnnoise as rn

    wide = np.clip(soxr.resample(audio, SR, RNNOISE_RATE), -1, 32766 / 32767).astype(np.float32)
    state = rn.create()
    try:
        frames = [
            rn.process_mono_frame(state, wide[i : i + rn.FRAME_SIZE])[0] for i in range(0, wide.size, rn.FRAME_SIZE)
        ]
    finally:
        rn.destroy(state)
    out = np.concatenate(frames).astype(np.float32) / 32767
    return soxr.resample(out, RNNOISE_RATE, SR).astype(np.float32)


def spectral_gate(audio: Audio) -> Audio:
    import noisereduce

    return np.asarray(noisereduce.reduce_noise(y=audio, sr=SR, stationary=True, n_jobs=1), dtype=np.float32)


SUPPRESSORS: dict[str, Callable[[Audio], Audio]] = {
    "none": lambda audio: audio,
    "rnnoise": rnnoise,
    "spectral gating": spectral_gate,
}


def _pink(rng: np.random.Generator, n: int) -> Audio:
    """Unit-power 1/f noise (Kellet's filter over white noise): the rumble of rooms and machines."""
    from scipy.signal import lfilter

    b = [0.049922035, -0.095993537, 0.050612699, -0.004408786]
    a = [1, -2.494956002, 2.017265875, -0.522189400]
    pink = lfilter(b, a, rng.normal(0, 1, n))
    return (pink / pink.std()).astype(np.float32)


def _hum(n: int) -> Audio:
    """Mains hum: 50 Hz and its first harmonics."""
    t = np.arange(n) / SR
    return np.sum([np.sin(2 * np.pi * 50 * k * t) / k for k in (1, 2, 3, 4, 5)], axis=0).astype(np.float32)


def _babble(clips: list[ManifestClip], n: int) -> Audio:
    """Six other speakers at once, each looped to `n` samples: a busy room."""
    mix = np.zeros(n, np.float32)
    for clip in clips[:6]:
        voice = np.resize(load_audio(clip.audio), n)
        mix += voice / (voice.std() + 1e-9)
    return (mix / mix.std()).astype(np.float32)


def _reverb(audio: Audio, rng: np.random.Generator, rt60: float = 0.5) -> Audio:
    """A far microphone: the speech through a synthetic room (exponentially decaying noise, RT60 `rt60`)."""
    from scipy.signal import fftconvolve

    t = np.arange(int(1.2 * rt60 * SR)) / SR
    response = rng.normal(0, 1, t.size) * np.exp(-6.9 * t / rt60)
    response[0] = 8.0  # the direct path
    wet = fftconvolve(audio, response)[: audio.size]
    return (wet * np.sqrt(np.mean(audio**2)) / np.sqrt(np.mean(wet**2))).astype(np.float32)


def _level(speech: Audio) -> float:
    """The RMS level of the speech itself (its silences left out): what an SNR is measured against."""
    return float(np.sqrt(np.mean(speech[np.abs(speech) > 1e-4] ** 2)))


def _mix(speech: Audio, noise: Audio, level: float, snr: float) -> Audio:
    """`noise` scaled to `snr` dB below `level`, added to `speech` (clipped to full scale)."""
    return np.clip(speech + noise / noise.std() * level * 10 ** (-snr / 20), -1, 1).astype(np.float32)


def speech_conditions(clips: list[ManifestClip], others: list[ManifestClip], seed: int = 0) -> dict[str, Audio]:
    """The clips between 0.5-s pauses, clean and under noise at a given SNR (against the speech's level)."""
    rng = np.random.default_rng(seed)
    speech = np.concatenate([x for c in clips for x in (load_audio(c.audio), np.zeros(SR // 2, np.float32))])
    level = _level(speech)

    def plus(noise: Audio, snr: float, base: Audio = speech) -> Audio:
        return _mix(base, noise, level, snr)

    return {
        "clean": speech,
        "white noise, 5 dB SNR": plus(rng.normal(0, 1, speech.size), 5),
        "pink noise, 5 dB SNR": plus(_pink(rng, speech.size), 5),
        "babble, 10 dB SNR": plus(_babble(others, speech.size), 10),
        "babble, 5 dB SNR": plus(_babble(others, speech.size), 5),
        "mains hum, 0 dB SNR": plus(_hum(speech.size), 0),
        "far field: reverb and pink noise, 10 dB SNR": plus(_pink(rng, speech.size), 10, _reverb(speech, rng)),
    }


def noise_alone(seed: int = 0, seconds: int = 60) -> dict[str, Audio]:
    """A minute of each kind of noise with nobody speaking."""
    rng = np.random.default_rng(seed)
    n = seconds * SR
    clicks = np.zeros(n)
    for start in rng.integers(0, n - 200, 4 * seconds):  # typing: four keystrokes a second
        clicks[start : start + 200] += rng.normal(0, 1, 200) * np.exp(-np.arange(200) / 30)

    def at(noise: Audio, dbfs: float) -> Audio:
        return (noise / noise.std() * 10 ** (dbfs / 20)).astype(np.float32)

    return {
        "white noise, -15 dBFS": at(rng.normal(0, 1, n), -15),
        "pink noise, -20 dBFS": at(_pink(rng, n), -20),
        "mains hum, -20 dBFS": at(_hum(n), -20),
        "keyboard, -25 dBFS": at(clicks, -25),
        "music-like tones": music(seconds),
    }


def turns_in_noise(
    clips: list[ManifestClip], others: list[ManifestClip], seed: int = 0
) -> tuple[dict[str, Audio], int]:
    """The clips as turns between 2-s gaps, under pink noise and babble; and how many turns there are."""
    rng = np.random.default_rng(seed)
    gap = np.zeros(2 * SR, np.float32)
    speech = np.concatenate([x for c in clips for x in (gap, load_audio(c.audio))] + [gap])
    level = _level(speech)

    def plus(noise: Audio, snr: float) -> Audio:
        return _mix(speech, noise, level, snr)

    conditions = {f"pink noise, {snr} dB SNR": plus(_pink(rng, speech.size), snr) for snr in (10, 0)}
    conditions["babble, 10 dB SNR"] = plus(_babble(others, speech.size), 10)
    return conditions, len(clips)


def _starts(vad: SileroVad, audio: Audio) -> int:
    """Speech starts turn detection reports on a live stream of `audio` in 20-ms chunks."""
    stream = vad.stream(VadParams())
    step = SR // 50
    return sum(e.kind == "start" for i in range(0, audio.size, step) for e in stream.feed(audio[i : i + step]))


def run_noise_reduction(
    transcribe: Callable[[Audio], str], clips: list[ManifestClip], others: list[ManifestClip]
) -> dict[str, Any]:
    """WER with each suppressor before the model; false starts and turns found with it before the VAD."""
    text = " ".join(c.text for c in clips)
    speech = speech_conditions(clips, others)
    noise = noise_alone()
    turns, count = turns_in_noise(clips, others)
    vad = SileroVad().load()
    runs = len(SUPPRESSORS) * (len(speech) + len(noise) + len(turns))
    with tqdm(total=runs, desc="noise reduction", unit="run") as bar:

        def table(conditions: dict[str, Audio], measure: Callable[[Audio], float]) -> dict[str, dict[str, float]]:
            """measure(suppressed audio) per condition and suppressor."""
            rows: dict[str, dict[str, float]] = {}
            for name, audio in conditions.items():
                rows[name] = {}
                for suppressor, apply in SUPPRESSORS.items():
                    bar.set_postfix_str(f"{name}: {suppressor}")
                    rows[name][suppressor] = measure(apply(audio))
                    bar.update()
            return rows

        return {
            "wer": table(speech, lambda audio: round(error_rate([(text, transcribe(audio), "en")]), 4)),
            "false starts per minute": table(
                noise, lambda audio: round(_starts(vad, audio) / (audio.size / SR / 60), 2)
            ),
            f"turns found of {count}": table(turns, lambda audio: _starts(vad, audio)),
        }


def run_noise_reduction_bench(manifest: Path, clips: int = 24) -> dict[str, Any]:
    """The measurement on the first `clips` English short clips (the next six make the babble), through a server."""
    english = [c for c in read_manifest(manifest) if c.language == "en" and c.subset == "short"]
    speakers, babble = english[:clips], english[clips : clips + 6]
    server = ServerProcess({"SPECWHISPER_SPECULATION": "always"}).start()
    try:
        ours = Ours(server)
        return run_noise_reduction(lambda audio: ours(audio, "none", True), speakers, babble)
    finally:
        server.stop()
