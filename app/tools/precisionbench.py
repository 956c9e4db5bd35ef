"""Precision side by side (`python -m app bench-precision --dtypes float32,int8`): the same clips through an engine
of each dtype, all resident in one process and run interleaved, main-only and speculative.

Reported per dtype: the encoder's time a window, decode and end-to-end times, tokens per main pass, whether
speculative decoding gave that dtype's own main-only tokens (alone and in batches of 4), and the word error rate
on each set: the English clips, each other language, and English speech under noise and over a telephone line
(`app.tools.realaudio.build_conditions`). Then the ratios of each dtype against the first.

A set of ten clips holds ~300 words, so one word is 0.3 points (0.8 in a ~130-word condition), and a numerically
neutral change flips words: the fp32 model itself, given each French clip with white noise at -80 dBFS added, wrote
1.6-2.3 points more errors.
`dithers=N` measures that spread: each clip (and condition) is also transcribed main-only N times more, each time
with its own seeded dither (`DITHER_RMS`), the same dithered audio for every dtype, and each set reports its WER's
mean, least and most over the N + 1 runs, the ratios the mean's difference (a paired comparison).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from app.api.audio import load_audio
from app.api.types import DecodingOptions, Transcription
from app.engine.build import build_engine
from app.engine.engine import Engine
from app.model.features import N_SAMPLES, log_mel, window
from app.settings import DtypeName, Settings
from app.tools.bench import error_rate
from app.tools.manifest import ManifestClip, read_manifest, select
from app.tools.realaudio import build_conditions

SPOKEN_CONDITIONS = ("noise 20 dB SNR", "noise 10 dB SNR", "noise 5 dB SNR", "telephone (G.711)")
BATCH = 4
# -80 dBFS: inaudible, far below the recordings' own noise; it moves only the arithmetic's close calls
DITHER_RMS = 1e-4


@dataclass
class Runs:
    """One dtype's answers: per set, (reference, plain, speculative, language) for each clip."""

    by_set: dict[str, list[tuple[str, Transcription, Transcription, str]]] = field(default_factory=dict)
    dithered: dict[str, dict[int, list[tuple[str, str, str]]]] = field(default_factory=dict)  # set -> run -> rows
    batches_identical: list[bool] = field(default_factory=list)
    encoder_s: list[float] = field(default_factory=list)

    def add(self, name: str, reference: str, plain: Transcription, spec: Transcription, language: str) -> None:
        self.by_set.setdefault(name, []).append((reference, plain, spec, language))

    def add_dithered(self, name: str, run: int, reference: str, text: str, language: str) -> None:
        self.dithered.setdefault(name, {}).setdefault(run, []).append((reference, text, language))


def dithered(audio: np.ndarray, key: str, run: int) -> np.ndarray:
    """`audio` with white noise at `DITHER_RMS` added, seeded by `key` and `run`: the same for every dtype."""
    rng = np.random.default_rng([zlib.crc32(key.encode()), run])
    return audio + rng.normal(0.0, DITHER_RMS, audio.size).astype(np.float32)


def _encoder_seconds(engine: Engine, audio: np.ndarray) -> float:
    """One 30-s window through the main encoder, timed alone."""
    features = window(log_mel(audio, engine.main.n_mels, padding=N_SAMPLES), 0).unsqueeze(0)
    started = time.perf_counter()
    engine.main.encode(features)
    return time.perf_counter() - started


def _sets(clips: list[ManifestClip], per_set: int | None) -> dict[str, list[ManifestClip]]:
    """English, then each other language, as the manifest orders them."""
    out: dict[str, list[ManifestClip]] = {}
    for clip in clips:
        out.setdefault(clip.language, []).append(clip)
    return {lang: members[: per_set or None] for lang, members in sorted(out.items(), key=lambda kv: kv[0] != "en")}


def _summary(runs: Runs, set_name: str | None = None) -> dict[str, Any]:
    rows = [row for name, rs in runs.by_set.items() if set_name in (None, name) for row in rs]
    plain = [p.metrics for _, p, _, _ in rows]
    spec = [s.metrics for _, _, s, _ in rows]
    tokens, passes = sum(m.tokens for m in spec), sum(m.main_passes for m in spec)
    wer = error_rate([(ref, s.text, lang) for ref, _, s, lang in rows])
    wers = [wer] + ([] if set_name is None else [error_rate(run) for run in runs.dithered.get(set_name, {}).values()])
    spread = {"wer_mean": statistics.mean(wers), "wer_min": min(wers), "wer_max": max(wers), "runs": len(wers)}
    return {
        "clips": len(rows),
        "identical_fraction": sum(p.tokens == s.tokens for _, p, s, _ in rows) / max(1, len(rows)),
        "wer": wer,
        **(spread if len(wers) > 1 else {}),
        "decode_ms_main": sum(m.decode_ms for m in plain),
        "decode_ms_spec": sum(m.decode_ms for m in spec),
        "total_ms_main": sum(m.total_ms for m in plain),
        "total_ms_spec": sum(m.total_ms for m in spec),
        "tokens_per_main_pass": tokens / passes if passes else 0.0,
    }


def _report(runs: Runs) -> dict[str, Any]:
    return {
        "encoder_ms_per_window": 1000 * statistics.median(runs.encoder_s) if runs.encoder_s else None,
        "batch_identical_fraction": (
            sum(runs.batches_identical) / len(runs.batches_identical) if runs.batches_identical else None
        ),
        "all": _summary(runs),
        "sets": {name: _summary(runs, name) for name in runs.by_set},
    }


def _ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How `other` compares with `base`: speed-ups (base time / other time) and WER differences in points."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    english, base_english = other["sets"].get("en", other["all"]), base["sets"].get("en", base["all"])
    return {
        "encoder_speedup": ratio(base["encoder_ms_per_window"], other["encoder_ms_per_window"]),
        "spec_e2e_speedup_english": ratio(base_english["total_ms_spec"], english["total_ms_spec"]),
        "main_e2e_speedup_english": ratio(base_english["total_ms_main"], english["total_ms_main"]),
        "spec_decode_speedup_english": ratio(base_english["decode_ms_spec"], english["decode_ms_spec"]),
        "wer_points_by_set": {
            name: 100 * (s["wer"] - base["sets"][name]["wer"])
            for name, s in other["sets"].items()
            if name in base["sets"]
        },
        "wer_mean_points_by_set": {
            name: 100 * (s["wer_mean"] - base["sets"][name]["wer_mean"])
            for name, s in other["sets"].items()
            if "wer_mean" in s and "wer_mean" in base["sets"].get(name, {})
        },
    }


def run_precision_bench(
    manifest: Path,
    dtypes: Sequence[DtypeName],
    *,
    per_set: int | None = None,
    languages: set[str] | None = None,
    condition_clips: int = 8,
    dithers: int = 0,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """The report (see the module's docstring); `per_set`: at most that many clips of each language (of
    `languages`, default all); `condition_clips`: English clips joined into each noise and telephone condition;
    `dithers`: dithered main-only runs of every clip and condition besides the clean one."""
    base = settings or Settings()
    engines = {dtype: build_engine(base.model_copy(update={"dtype": dtype}), progress=False) for dtype in dtypes}
    clips = select(read_manifest(manifest), languages=languages, subset="short", max_seconds=30.0)
    sets = _sets(clips, per_set)
    audio = {c.id: load_audio(c.audio) for members in sets.values() for c in members}
    runs = {dtype: Runs() for dtype in dtypes}
    first = next(iter(audio.values()))
    for engine in engines.values():  # one-off costs, and the warm-up's batch-invariance check
        engine.warm_up({1, BATCH})
    for name, members in sets.items():
        for clip in tqdm(members, desc=f"clips ({name})", unit="clip"):
            for dtype, engine in engines.items():
                plain, spec = _both(engine, [audio[clip.id]], [DecodingOptions(language=clip.language)])
                runs[dtype].add(name, clip.text, plain[0], spec[0], clip.language)
            _dithered(engines, runs, name, clip.id, audio[clip.id], clip.text, clip.language, dithers)
    english = sets.get("en", [])
    for start in range(0, len(english) - BATCH + 1, BATCH):
        group = english[start : start + BATCH]
        options = [DecodingOptions(language="en")] * len(group)
        for dtype, engine in engines.items():
            plain, spec = _both(engine, [audio[c.id] for c in group], options)
            runs[dtype].batches_identical.append([p.tokens for p in plain] == [s.tokens for s in spec])
    for _ in range(5):
        for dtype, engine in engines.items():
            runs[dtype].encoder_s.append(_encoder_seconds(engine, first))
    if condition_clips:
        for condition in build_conditions(english[:condition_clips]):
            if condition.name not in SPOKEN_CONDITIONS or condition.reference is None:
                continue
            for dtype, engine in tqdm(engines.items(), desc=condition.name, unit="dtype"):
                plain, spec = _both(engine, [condition.audio], [DecodingOptions(language="en")])
                runs[dtype].add(condition.name, condition.reference, plain[0], spec[0], "en")
            name = condition.name
            _dithered(engines, runs, name, name, condition.audio, condition.reference, "en", dithers)
    reports = {dtype: _report(r) for dtype, r in runs.items()}
    first_dtype = dtypes[0]
    return {
        "engines": {dtype: engine.describe() for dtype, engine in engines.items()},
        "threads": torch.get_num_threads(),
        "dtypes": reports,
        "against": first_dtype,
        "ratios": {d: _ratios(reports[first_dtype], reports[d]) for d in dtypes[1:]},
    }


def _dithered(
    engines: dict[DtypeName, Engine],
    runs: dict[DtypeName, Runs],
    set_name: str,
    key: str,
    audio: np.ndarray,
    reference: str,
    language: str,
    dithers: int,
) -> None:
    """`dithers` dithered main-only runs of one clip, each dtype on the same audio."""
    options = [DecodingOptions(language=language, use_assistant=False)]
    for run in range(dithers):
        noisy = dithered(audio, key, run)
        for dtype, engine in engines.items():
            runs[dtype].add_dithered(set_name, run, reference, engine.transcribe([noisy], options)[0].text, language)


def _both(
    engine: Engine, audio: list[np.ndarray], options: list[DecodingOptions]
) -> tuple[list[Transcription], list[Transcription]]:
    """Main-only, then speculative, on the same engine."""
    plain = engine.transcribe(audio, [dataclasses.replace(o, use_assistant=False) for o in options])
    return plain, engine.transcribe(audio, options)
