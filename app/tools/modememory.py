"""Each decoding mode's memory, measured in a process of its own (`python -m app bench`'s `peak_rss_mb`): a
spawned child builds the engine, transcribes, and reports its peaks, so that neither mode's allocations (nor the
bench's own) count in the other's."""

from __future__ import annotations

import multiprocessing
import resource
from pathlib import Path

from app.api.audio import load_audio
from app.api.types import DecodingOptions
from app.engine.drafting.assistants import NO_ASSISTANT
from app.server.memory import ProcessMemory, reset_peak
from app.settings import Settings
from app.tools.manifest import ManifestClip


def peak_rss_mb() -> float:
    """This process's peak resident set (MB). VmHWM, unlike ru_maxrss, is not inherited across exec,
    so a spawned child reports its own peak."""
    here = ProcessMemory.of()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if here is None else here.peak_mb


def _mode_peak_rss(
    settings: Settings, paths: list[Path], languages: list[str], batch: int
) -> tuple[float, float, float]:
    """In a fresh process: build the engine, transcribe each clip, then the first batch.

    Returns the peak RSS (MB) over the process's life and while serving (from the end of loading
    on), and the RSS once loaded. Loading holds transient copies that can exceed what decoding ever
    needs, and then both modes' lifetime peaks are the same load peak; the serving peak shows what
    each mode keeps, plus decoding's transient buffers, whose peak varies by tens of MB from run to
    run; the RSS once loaded is what each mode holds resident, steady to 0.1 MB between runs.
    """
    from app.engine.build import build_engine

    engine = build_engine(settings, progress=False)
    here = ProcessMemory.of()
    loaded = here.rss_mb if here is not None else float("nan")
    load_peak = peak_rss_mb()
    separate = reset_peak()
    use = settings.assistant != NO_ASSISTANT
    clips = [load_audio(p) for p in paths]
    for clip, language in zip(clips, languages, strict=True):
        engine.transcribe([clip], [DecodingOptions(language=language, use_assistant=use)])
    engine.transcribe(clips[:batch], [DecodingOptions(language=lang, use_assistant=use) for lang in languages[:batch]])
    serving = peak_rss_mb()
    return max(load_peak, serving), serving if separate else float("nan"), loaded


def peak_rss_by_mode(settings: Settings, entries: list[ManifestClip], batch: int) -> dict[str, float]:
    """Peak RSS of a main-only engine and of the speculative engine, each in its own child process,
    over the longest clip alone and the first `batch` clips together, over the process's life and
    while serving (`*_serving`, NaN where the peak cannot be reset); the RSS once loaded
    (`*_loaded`); and the assistant's shares."""
    longest = max(entries, key=lambda e: e.duration_s)
    chosen = [longest, *[e for e in entries[:batch] if e is not longest]][: max(batch, 1)]
    paths = [e.audio for e in chosen]
    languages = [e.language for e in chosen]
    modes = {"main_only": settings.model_copy(update={"assistant": NO_ASSISTANT}), "speculative": settings}
    out: dict[str, float] = {}
    context = multiprocessing.get_context("spawn")
    for name, mode_settings in modes.items():
        with context.Pool(1) as pool:
            peaks = pool.apply(_mode_peak_rss, (mode_settings, paths, languages, batch))
            out[name], out[f"{name}_serving"], out[f"{name}_loaded"] = peaks
    if settings.assistant != NO_ASSISTANT:
        out["assistant_share"] = (out["speculative"] - out["main_only"]) / out["main_only"]
        for kind in ("serving", "loaded"):
            main_only = out[f"main_only_{kind}"]
            out[f"assistant_share_{kind}"] = (out[f"speculative_{kind}"] - main_only) / main_only
    return out
