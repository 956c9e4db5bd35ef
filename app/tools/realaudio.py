"""Real-world audio, measured: words made up on non-speech, WER on hard speech, and long files.

`python -m app bench-audio` builds its audio from the benchdata speech and generated non-speech, starts a
server (speculation always, so `speculative=false` is main-only) and runs, side by side on the same audio:

* conditions: digital silence, room hiss, loud noise and music-like tones (every word is made up: reported
  per minute), speech with long pauses, speech in noise at 20, 10 and 5 dB SNR, and telephone speech (8 kHz,
  G.711 mu-law): WER. Systems: ours in one block and with `chunking_strategy=auto`, each speculative and
  main-only (which must give the same text), faster-whisper on the same converted weights with `vad_filter`
  off and on (greedy, as ours, and its default fallback), and optionally openai-whisper's `transcribe()`.
* a long file (>= 10 minutes of speech with pauses): wall time (the best of two runs, the systems taking
  turns) and WER of our sequential long-form, ours chunked and batched, faster-whisper sequential and
  faster-whisper's `BatchedInferencePipeline` (batch 4, its default VAD).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import soxr
from tqdm import tqdm

from app.api.audio import SAMPLE_RATE, decode_audio, load_audio
from app.api.types import FALLBACK_TEMPERATURES
from app.settings import Settings
from app.tools.bench import error_rate, normalize
from app.tools.comparisons import load_faster_whisper
from app.tools.manifest import ManifestClip, read_manifest
from app.tools.process import ServerProcess

SR = SAMPLE_RATE
NON_SPEECH_SECONDS = 60


@dataclass(frozen=True)
class Condition:
    name: str
    audio: np.ndarray
    reference: str | None  # None: non-speech, where every word is made up

    @property
    def minutes(self) -> float:
        return self.audio.size / SR / 60


def _encoded(audio: np.ndarray, rate: int = SR, container: str = "FLAC", subtype: str = "PCM_16") -> bytes:
    """`audio` as a file: FLAC by default (lossless, and a long recording stays within the upload limit)."""
    out = io.BytesIO()
    sf.write(out, audio, rate, format=container, subtype=subtype)
    return out.getvalue()


def music(seconds: float) -> np.ndarray:
    """Chords that change every half second, with a beat and harmonics: music-like, not speech."""
    t = np.arange(int(seconds * SR)) / SR
    root = 110 * 2 ** (np.array([0, 5, 7, 3])[(t // 2).astype(int) % 4] / 12)
    tone = sum(np.sin(2 * np.pi * root * f * t) / f for f in (1, 1.25, 1.5, 2, 3))
    beat = 0.6 + 0.4 * (np.sin(2 * np.pi * 2 * t) > 0)
    return (0.08 * tone * beat).astype(np.float32)


def build_conditions(clips: list[ManifestClip], seed: int = 0) -> list[Condition]:
    """The hard-audio set: non-speech, and English speech under pauses, noise and a telephone line."""
    rng = np.random.default_rng(seed)
    speech = [load_audio(c.audio) for c in clips]
    text = " ".join(c.text for c in clips)

    def joined(pause: Callable[[], float]) -> np.ndarray:
        return np.concatenate([x for s in speech for x in (s, np.zeros(int(pause() * SR), np.float32))])

    close = joined(lambda: 0.5)
    level = float(np.sqrt(np.mean(close[np.abs(close) > 1e-4] ** 2)))
    n = NON_SPEECH_SECONDS * SR
    conditions = [
        Condition("silence", np.zeros(n, np.float32), None),
        Condition("room hiss", (rng.normal(0, 10 ** (-50 / 20), n)).astype(np.float32), None),
        Condition("loud noise", (rng.normal(0, 0.1, n)).astype(np.float32), None),
        Condition("music", music(NON_SPEECH_SECONDS), None),
        Condition("long pauses", joined(lambda: float(rng.uniform(8, 20))), text),
    ]
    for snr in (20, 10, 5):
        noise = rng.normal(0, level * 10 ** (-snr / 20), close.size).astype(np.float32)
        conditions.append(Condition(f"noise {snr} dB SNR", np.clip(close + noise, -1, 1), text))
    narrow = soxr.resample(close, SR, 8000).astype(np.float32)
    conditions.append(Condition("telephone (G.711)", decode_audio(_encoded(narrow, 8000, "WAV", "ULAW")), text))
    return conditions


def long_recording(clips: list[ManifestClip], minutes: float, seed: int = 0) -> tuple[np.ndarray, str]:
    """At least `minutes` of the clips' speech, in turn, between pauses of 0.5 to 4 s; and its text."""
    rng = np.random.default_rng(seed)
    parts, texts, total = [], [], 0
    k = 0
    while total < minutes * 60 * SR:
        clip = clips[k % len(clips)]
        audio = load_audio(clip.audio)
        pause = np.zeros(int(rng.uniform(0.5, 4) * SR), np.float32)
        parts += [audio, pause]
        texts.append(clip.text)
        total += audio.size + pause.size
        k += 1
    return np.concatenate(parts), " ".join(texts)


class Ours:
    """Our server over HTTP: one block or `chunking_strategy=auto`, speculative or main-only."""

    def __init__(self, server: ServerProcess) -> None:
        self.url = f"{server.url}/v1/audio/transcriptions"

    def __call__(self, audio: np.ndarray, chunking: str, speculative: bool) -> str:
        fields = {"model": "whisper-1", "language": "en", "chunking_strategy": chunking}
        fields["speculative"] = "true" if speculative else "false"
        response = httpx.post(self.url, data=fields, files={"file": ("a.flac", _encoded(audio))}, timeout=3600)
        response.raise_for_status()
        return str(response.json()["text"])


def _faster(model: Any, audio: np.ndarray, vad: bool) -> str:
    segments, _ = model.transcribe(audio, language="en", beam_size=1, vad_filter=vad)
    return "".join(s.text for s in segments).strip()


def _score(condition: Condition, text: str) -> float:
    """Words per minute on non-speech; WER on speech."""
    if condition.reference is None:
        return len(normalize(text).split()) / condition.minutes
    return error_rate([(condition.reference, text, "en")])


def _systems(ours: Ours, fw: Any, reference: Any | None) -> dict[str, Callable[[np.ndarray], str]]:
    systems: dict[str, Callable[[np.ndarray], str]] = {
        "ours": lambda a: ours(a, "none", True),
        "ours main-only": lambda a: ours(a, "none", False),
        "ours chunked": lambda a: ours(a, "auto", True),
        "ours chunked main-only": lambda a: ours(a, "auto", False),
        "faster-whisper": lambda a: _faster(fw, a, vad=False),
        "faster-whisper vad": lambda a: _faster(fw, a, vad=True),
    }
    if reference is not None:
        from app.tools.reference import reference_transcribe

        systems["openai-whisper"] = lambda a: str(
            reference_transcribe(reference, a, temperature=FALLBACK_TEMPERATURES, language="en")["text"]
        ).strip()
    return systems


def run_conditions(ours: Ours, fw: Any, reference: Any | None, clips: list[ManifestClip]) -> dict[str, Any]:
    conditions = build_conditions(clips)
    systems = _systems(ours, fw, reference)
    report: dict[str, Any] = {}
    with tqdm(total=len(conditions) * len(systems), desc="conditions", unit="run") as bar:
        for condition in conditions:
            row: dict[str, Any] = {"minutes": round(condition.minutes, 2)}
            texts = {}
            for name, system in systems.items():
                bar.set_postfix_str(f"{condition.name}: {name}")
                started = time.perf_counter()
                texts[name] = system(condition.audio)
                row[name] = {
                    "score": round(_score(condition, texts[name]), 4),
                    "seconds": round(time.perf_counter() - started, 2),
                }
                bar.update()
            row["metric"] = "words per minute" if condition.reference is None else "WER"
            row["speculative = main-only"] = (
                texts["ours"] == texts["ours main-only"] and texts["ours chunked"] == texts["ours chunked main-only"]
            )
            report[condition.name] = row
    return report


def run_long(ours: Ours, fw: Any, clips: list[ManifestClip], minutes: float, runs: int = 2) -> dict[str, Any]:
    from faster_whisper import BatchedInferencePipeline

    audio, text = long_recording(clips, minutes)
    batched = BatchedInferencePipeline(model=fw)
    systems: dict[str, Callable[[], str]] = {
        "ours sequential": lambda: ours(audio, "none", True),
        "ours chunked (batched)": lambda: ours(audio, "auto", True),
        "faster-whisper sequential": lambda: _faster(fw, audio, vad=False),
        "faster-whisper batched": lambda: "".join(
            s.text for s in batched.transcribe(audio, language="en", beam_size=1, batch_size=4)[0]
        ).strip(),
    }
    report: dict[str, Any] = {"minutes": round(audio.size / SR / 60, 2), "runs": runs}
    times: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, str] = {}
    with tqdm(total=runs * len(systems), desc="long file", unit="run") as bar:
        for _ in range(runs):  # the systems take turns, so that a slow spell of the machine hits them alike
            for name, system in systems.items():
                started = time.perf_counter()
                outputs[name] = system()
                times[name].append(round(time.perf_counter() - started, 2))
                bar.update()
    for name in systems:
        wer = round(error_rate([(text, outputs[name], "en")]), 4)
        report[name] = {"seconds": min(times[name]), "all seconds": times[name], "wer": wer}
    sequential = report["ours sequential"]["seconds"]
    for name in systems:
        report[name]["speedup vs ours sequential"] = round(sequential / report[name]["seconds"], 2)
    return report


def run_bench_audio(
    manifest: Path, part: str, minutes: float, with_reference: bool, threads: int, clips: int = 24
) -> dict[str, Any]:
    entries = read_manifest(manifest)
    english = [c for c in entries if c.language == "en" and c.subset == "short"]
    server = ServerProcess({"SPECWHISPER_SPECULATION": "always"}).start()
    handle, fw = load_faster_whisper("whisper-base", threads)
    try:
        ours = Ours(server)
        warm = load_audio(english[0].audio)
        ours(warm, "none", True)  # first calls pay one-off costs
        _faster(fw, warm, vad=True)
        report: dict[str, Any] = {}
        if part in ("conditions", "all"):
            reference = None
            if with_reference:
                from app.store.catalog import ModelStore
                from app.tools.reference import load_reference

                reference = load_reference(ModelStore(Settings().models_dir).path("whisper-base"))
            report["conditions"] = run_conditions(ours, fw, reference, english[:clips])
        if part in ("long", "all"):
            report["long"] = run_long(ours, fw, english, minutes)
        return report
    finally:
        server.stop()
        handle.cleanup()
