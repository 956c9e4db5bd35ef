"""Side-by-side benchmark: main-only greedy vs speculative decoding in the same engine, same run."""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.audio import load_audio
from app.engine.transcriber import DecodingOptions, Engine, Transcription

CHARACTER_LANGUAGES = {"ja", "ko", "zh", "th", "yue"}


def normalize(text: str) -> str:
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer

    return str(BasicTextNormalizer()(text))


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def error_units(text: str, language: str) -> list[str]:
    """Words, or characters for languages written without spaces (CER)."""
    norm = normalize(text)
    return list(norm.replace(" ", "")) if language in CHARACTER_LANGUAGES else norm.split()


@dataclass
class ClipRun:
    clip_id: str
    language: str
    plain: Transcription
    spec: Transcription
    reference: str

    @property
    def identical(self) -> bool:
        return self.plain.tokens == self.spec.tokens


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _errors(runs: list[ClipRun], which: str) -> float:
    errors = units = 0
    for r in runs:
        ref = error_units(r.reference, r.language)
        hyp = error_units(getattr(r, which).text, r.language)
        errors += edit_distance(ref, hyp)
        units += len(ref)
    return errors / units if units else 0.0


def _summary(runs: list[ClipRun]) -> dict[str, Any]:
    plain_decode = sum(r.plain.metrics.decode_ms for r in runs)
    spec_decode = sum(r.spec.metrics.decode_ms for r in runs)
    plain_total = sum(r.plain.metrics.total_ms for r in runs)
    spec_total = sum(r.spec.metrics.total_ms for r in runs)
    drafted = sum(r.spec.metrics.draft_proposed for r in runs)
    accepted = sum(r.spec.metrics.draft_accepted for r in runs)
    tokens = sum(r.spec.metrics.tokens for r in runs)
    passes = sum(r.spec.metrics.main_passes for r in runs)
    return {
        "clips": len(runs),
        "identical_fraction": sum(r.identical for r in runs) / len(runs),
        "decode_speedup": plain_decode / spec_decode if spec_decode else 0.0,
        "e2e_speedup": plain_total / spec_total if spec_total else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_main_pass": tokens / passes if passes else 0.0,
        "wer_main": _errors(runs, "plain"),
        "wer_spec": _errors(runs, "spec"),
        "decode_ms_main": plain_decode,
        "decode_ms_spec": spec_decode,
        "total_ms_main": plain_total,
        "total_ms_spec": spec_total,
    }


def run_bench(
    engine: Engine,
    manifest: Path,
    *,
    languages: set[str] | None,
    limit: int | None,
    batches: Sequence[int],
    max_seconds: float = 30.0,
) -> dict[str, Any]:
    entries = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    entries = [
        e for e in entries if e["duration_s"] <= max_seconds and (languages is None or e["language"] in languages)
    ][: limit or None]
    if not entries:
        raise ValueError("no clips match the filters")
    audio = {e["id"]: load_audio(manifest.parent / e["audio"]) for e in entries}
    warm = audio[entries[0]["id"]]
    for use in (False, True):  # warm-up: allocator, thread pools, quantized kernels
        engine.transcribe([warm], [DecodingOptions(language=entries[0]["language"], use_assistant=use)])
    rss_main = _peak_rss_mb()
    runs: list[ClipRun] = []
    for e in tqdm(entries, desc="bench", unit="clip"):
        opts = DecodingOptions(language=e["language"])
        plain = engine.transcribe([audio[e["id"]]], [DecodingOptions(language=e["language"], use_assistant=False)])[0]
        spec = engine.transcribe([audio[e["id"]]], [opts])[0]
        runs.append(ClipRun(e["id"], e["language"], plain, spec, e["text"]))
    report = _summary(runs)
    report["peak_rss_mb"] = {"after_main_only_warmup": rss_main, "overall": _peak_rss_mb()}
    by_language: dict[str, list[ClipRun]] = defaultdict(list)
    for r in runs:
        by_language[r.language].append(r)
    report["languages"] = {lang: _summary(rs) for lang, rs in sorted(by_language.items())}
    report["per_clip"] = [
        {
            "id": r.clip_id,
            "language": r.language,
            "identical": r.identical,
            "decode_speedup": r.plain.metrics.decode_ms / r.spec.metrics.decode_ms if r.spec.metrics.decode_ms else 0,
            "acceptance_rate": r.spec.metrics.acceptance_rate,
        }
        for r in runs
    ]
    report["batches"] = {str(b): _batch_throughput(engine, entries, audio, b) for b in batches}
    return report


def _batch_throughput(engine: Engine, entries: list[dict], audio: dict, size: int) -> dict[str, float]:
    groups = [entries[i : i + size] for i in range(0, len(entries) - size + 1, size)] or [entries[:size]]
    seconds = {False: 0.0, True: 0.0}
    identical = True
    for group in groups:
        clips = [audio[e["id"]] for e in group]
        out = {}
        for use in (False, True):
            opts = [DecodingOptions(language=e["language"], use_assistant=use) for e in group]
            t = time.perf_counter()
            out[use] = engine.transcribe(clips, opts)
            seconds[use] += time.perf_counter() - t
        identical &= [r.tokens for r in out[False]] == [r.tokens for r in out[True]]
    audio_s = sum(len(audio[e["id"]]) / 16000 for g in groups for e in g)
    return {
        "audio_seconds_per_second_main": audio_s / seconds[False],
        "audio_seconds_per_second_spec": audio_s / seconds[True],
        "throughput_ratio": seconds[False] / seconds[True],
        "identical": identical,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clips = report["per_clip"]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.scatter([c["acceptance_rate"] for c in clips], [c["decode_speedup"] for c in clips])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft acceptance rate")
    ax.set_ylabel("decode speedup (main-only / speculative)")
    ax.set_title(f"{report['clips']} clips, decode speedup {report['decode_speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path)
