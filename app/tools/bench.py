"""Side-by-side benchmark: main-only vs speculative decoding in the same engine, same run, greedy and with beam
search (`--beam 1,5`).

Each clip runs through both modes back to back (after a warm-up); optionally the same clips then
run through transformers' `generate` (plain and assisted) and faster-whisper on the same weights
(`app/tools/comparisons.py`), each family in its own child process so that its runtime cannot slow
the engine. Peak memory is measured per mode, each in its own child process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jiwer
import numpy as np
import torch
from tqdm import tqdm

from app.api.audio import load_audio
from app.api.types import DecodingOptions, Transcription
from app.engine.drafting.assistants import NO_ASSISTANT
from app.engine.engine import Engine
from app.model.cpu import cpu_name
from app.settings import Settings
from app.tools.comparisons import ClipRunner, FasterWhisper, HFGenerate, RunResult
from app.tools.manifest import ManifestClip, read_manifest, select
from app.tools.modememory import peak_rss_by_mode, peak_rss_mb

CHARACTER_LANGUAGES = {"ja", "ko", "zh", "th", "yue"}


def normalize(text: str) -> str:
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer

    return str(BasicTextNormalizer()(text))


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Word (unit) substitutions, deletions and insertions turning `ref` into `hyp` (jiwer's alignment)."""
    if not ref or not hyp:
        return max(len(ref), len(hyp))
    out = jiwer.process_words(" ".join(ref), " ".join(hyp))
    return int(out.substitutions + out.deletions + out.insertions)


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
    baselines: dict[str, RunResult] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.plain.tokens == self.spec.tokens


def error_rate(pairs: Sequence[tuple[str, str, str]]) -> float:
    """WER (CER for languages without spaces) over (reference, hypothesis, language) triples."""
    errors = units = 0
    for reference, hypothesis, language in pairs:
        ref = error_units(reference, language)
        errors += edit_distance(ref, error_units(hypothesis, language))
        units += len(ref)
    return errors / units if units else 0.0


def _errors(runs: list[ClipRun], which: str) -> float:
    return error_rate([(r.reference, getattr(r, which).text, r.language) for r in runs])


def _baseline_summary(runs: list[ClipRun], name: str) -> dict[str, Any]:
    """A reference decoder against the engine: wall-time ratios, token agreement with main-only greedy, WER."""
    total = sum(r.baselines[name].total_ms for r in runs)
    spec_total = sum(r.spec.metrics.total_ms for r in runs)
    plain_total = sum(r.plain.metrics.total_ms for r in runs)
    return {
        "total_ms": total,
        "speedup_spec_vs_this": total / spec_total if spec_total else 0.0,
        "speedup_main_only_vs_this": total / plain_total if plain_total else 0.0,
        "identical_tokens_fraction": sum(r.baselines[name].tokens == r.plain.tokens for r in runs) / len(runs),
        "same_text_fraction": sum(
            error_units(r.baselines[name].text, r.language) == error_units(r.plain.text, r.language) for r in runs
        )
        / len(runs),
        "wer": error_rate([(r.reference, r.baselines[name].text, r.language) for r in runs]),
    }


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
        # What end-to-end speculation could reach if its decoding took no time: the share of a
        # request outside decoding (features, encoder, cross keys/values) is the same in both modes.
        "e2e_ceiling": plain_total / (plain_total - plain_decode) if plain_total > plain_decode else 0.0,
        "decode_ms_main": plain_decode,
        "decode_ms_spec": spec_decode,
        "total_ms_main": plain_total,
        "total_ms_spec": spec_total,
        **{name: _baseline_summary(runs, name) for name in (runs[0].baselines if runs else {})},
    }


def select_clips(
    manifest: Path,
    languages: set[str] | None,
    limit: int | None,
    max_seconds: float | None = None,
    subset: str | None = None,
) -> list[ManifestClip]:
    """Manifest clips in the given languages and subset ("short", "long"), the first `limit`.

    max_seconds: the longest clip taken; by default 30 s (one window), unbounded for the long subset.
    """
    if max_seconds is None:
        max_seconds = float("inf") if subset == "long" else 30.0
    clips = select(read_manifest(manifest), languages=languages, subset=subset, max_seconds=max_seconds)
    clips = clips[: limit or None]
    if not clips:
        raise ValueError("no clips match the filters")
    return clips


def run_bench(
    engine: Engine,
    manifest: Path,
    *,
    languages: set[str] | None,
    limit: int | None,
    batches: Sequence[int],
    max_seconds: float | None = None,
    subset: str | None = None,
    settings: Settings | None = None,
    rss_split: bool = True,
    compare_hf: bool = False,
    compare_faster_whisper: bool = False,
    beams: Sequence[int] = (1,),
) -> dict[str, Any]:
    """Run the clips through both modes at each beam size (1: greedy), interleaved per clip, then through the
    chosen reference decoders (faster-whisper at each beam size too).

    Each reference decoder runs in its own child process (it needs `settings`): loaded into the
    bench process, CTranslate2's OpenMP runtime and transformers slowed the engine's many small
    ops for the rest of the run (decode speedup 2.04x alone, 1.60-1.66x with them loaded, same
    clips). With `rss_split`, the peak RSS of each mode is measured in its own child process too.
    The summary is the first beam size's; `beams` holds each one's, and `beam_targets` the ratios that
    compare beam search with greedy decoding and with faster-whisper when beam sizes 1 and 5 both ran.
    """
    entries = select_clips(manifest, languages, limit, max_seconds, subset)
    audio = {e.id: load_audio(e.audio) for e in entries}
    warm = entries[0]
    for beam in beams:  # warm-up: allocator, thread pools, quantized kernels, each beam's batch width
        for use in (False, True):
            options = DecodingOptions(language=warm.language, use_assistant=use, beam_size=beam)
            engine.transcribe([audio[warm.id]], [options])
    by_beam: dict[int, list[ClipRun]] = {beam: [] for beam in beams}
    for e in tqdm(entries, desc="bench", unit="clip"):
        clip = audio[e.id]
        for beam in beams:
            plain_options = DecodingOptions(language=e.language, use_assistant=False, beam_size=beam)
            plain = engine.transcribe([clip], [plain_options])[0]
            spec = engine.transcribe([clip], [DecodingOptions(language=e.language, beam_size=beam)])[0]
            by_beam[beam].append(ClipRun(e.id, e.language, plain, spec, e.text))
    runs = by_beam[beams[0]]
    batch_report = {str(b): _batch_throughput(engine, entries, audio, b) for b in batches}
    kinds = [k for k, on in (("hf", compare_hf), ("faster_whisper", compare_faster_whisper)) if on]
    if kinds and settings is None:
        raise ValueError("the reference decoders need the settings to load the model in their own process")
    for kind in kinds:
        assert settings is not None
        for name, results in references_in_child(settings, kind, entries, beams).items():
            beam = int(name.removeprefix("faster_whisper_beam")) if name.startswith("faster_whisper_beam") else 1
            for run, result in zip(by_beam.get(beam, runs), results, strict=True):
                run.baselines[name.split("_beam")[0]] = result
    report = _summary(runs)
    report["beams"] = {str(beam): _summary(rs) for beam, rs in by_beam.items()}
    if 1 in by_beam and 5 in by_beam:
        report["beam_targets"] = beam_targets(report["beams"]["1"], report["beams"]["5"])
    report["machine"] = machine(engine)
    report["peak_rss_mb"] = {"bench_process": peak_rss_mb()}
    if settings is not None and rss_split:
        report["peak_rss_mb"].update(peak_rss_by_mode(settings, entries, max(batches, default=1)))
    by_language: dict[str, list[ClipRun]] = defaultdict(list)
    for r in runs:
        by_language[r.language].append(r)
    report["languages"] = {lang: _summary(rs) for lang, rs in sorted(by_language.items())}
    report["per_clip"] = [
        {
            "id": r.clip_id,
            "language": r.language,
            "beam_size": beam,
            "identical": r.identical,
            "decode_speedup": r.plain.metrics.decode_ms / r.spec.metrics.decode_ms if r.spec.metrics.decode_ms else 0,
            "e2e_speedup": r.plain.metrics.total_ms / r.spec.metrics.total_ms if r.spec.metrics.total_ms else 0,
            "acceptance_rate": r.spec.metrics.acceptance_rate,
            "tokens_per_main_pass": r.spec.metrics.tokens_per_main_pass,
            **{f"{name}_ms": b.total_ms for name, b in r.baselines.items()},
        }
        for beam, rs in by_beam.items()
        for r in rs
    ]
    report["batches"] = batch_report
    return report


def beam_targets(greedy: dict[str, Any], beam: dict[str, Any]) -> dict[str, Any]:
    """The beam-search targets as ratios of one run (greedy: the beam-1 summary, beam: the beam-5 one)."""
    out: dict[str, Any] = {
        "beam_spec_identical_to_beam_plain": beam["identical_fraction"],
        "beam_spec_decode_speedup_vs_beam_plain": beam["decode_speedup"],
        "beam_spec_e2e_vs_greedy_spec": beam["total_ms_spec"] / greedy["total_ms_spec"]
        if greedy["total_ms_spec"]
        else 0,
        "wer_greedy_spec": greedy["wer_spec"],
        "wer_beam_spec": beam["wer_spec"],
    }
    peer = beam.get("faster_whisper")
    if peer is not None:
        out["beam_spec_e2e_speedup_vs_faster_whisper_beam"] = peer["speedup_spec_vs_this"]
        out["wer_faster_whisper_beam"] = peer["wer"]
        out["wer_points_beam_spec_minus_faster_whisper_beam"] = round(100 * (beam["wer_spec"] - peer["wer"]), 3)
    return out


def machine(engine: Engine) -> dict[str, Any]:
    """What the figures were measured on: the CPU, torch, and what the engine runs (`Engine.describe`, after
    checking that the main decoder is batch-invariant here, if the engine has not yet)."""
    if engine.batch_invariant is None:
        engine.check_batch_invariance()
    return {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__, **engine.describe()}


def _references(
    settings: Settings, kind: str, entries: list[ManifestClip], beams: Sequence[int] = (1,)
) -> dict[str, list[RunResult]]:
    """In a fresh process: the reference decoders of `kind` over the clips (faster-whisper at each beam size),
    after one warm-up clip."""
    from app.engine.build import build_engine

    main = build_engine(settings.model_copy(update={"assistant": NO_ASSISTANT}), progress=False).main
    runners: list[ClipRunner]
    if kind == "hf":
        runners = [HFGenerate(main, assisted=False), HFGenerate(main, assisted=True)]
    else:
        runners = [FasterWhisper(main, threads=torch.get_num_threads(), beam_size=beam) for beam in beams]
    audio = [load_audio(e.audio) for e in entries]
    for runner in runners:
        runner.run(audio[0], entries[0].language)
    out: dict[str, list[RunResult]] = {runner.name: [] for runner in runners}
    for clip, e in zip(audio, entries, strict=True):  # interleaved per clip, like the engine's two modes
        for runner in runners:
            out[runner.name].append(runner.run(clip, e.language))
    return out


def references_in_child(
    settings: Settings, kind: str, entries: list[ManifestClip], beams: Sequence[int] = (1,)
) -> dict[str, list[RunResult]]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_references, (settings, kind, entries, beams))


def _batch_throughput(
    engine: Engine, entries: list[ManifestClip], audio: dict[str, np.ndarray], size: int
) -> dict[str, float | bool]:
    groups = [entries[i : i + size] for i in range(0, len(entries) - size + 1, size)] or [entries[:size]]
    seconds = {False: 0.0, True: 0.0}
    decode = {False: 0.0, True: 0.0}  # seconds; a batch's rows share its decoding time
    warm = groups[0]
    for use in (False, True):  # this batch size's own warm-up (allocations of the wider caches)
        engine.transcribe(
            [audio[e.id] for e in warm], [DecodingOptions(language=e.language, use_assistant=use) for e in warm]
        )
    identical = True
    for group in groups:
        clips = [audio[e.id] for e in group]
        out = {}
        for use in (False, True):
            opts = [DecodingOptions(language=e.language, use_assistant=use) for e in group]
            t = time.perf_counter()
            out[use] = engine.transcribe(clips, opts)
            seconds[use] += time.perf_counter() - t
            decode[use] += max(r.metrics.decode_ms for r in out[use]) / 1000
        identical &= [r.tokens for r in out[False]] == [r.tokens for r in out[True]]
    audio_s = sum(len(audio[e.id]) / 16000 for g in groups for e in g)
    outside_decoding = seconds[False] - decode[False]  # the same in both modes
    return {
        "audio_seconds_per_second_main": audio_s / seconds[False],
        "audio_seconds_per_second_spec": audio_s / seconds[True],
        "throughput_ratio": seconds[False] / seconds[True],
        "decode_ratio": decode[False] / decode[True] if decode[True] else 0.0,
        # the throughput ratio if speculative decoding took no time (the rest is shared by both modes)
        "throughput_ceiling": seconds[False] / outside_decoding if outside_decoding > 0 else 0.0,
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
