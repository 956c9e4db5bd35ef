"""`python -m app transcribe`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from app.api.audio import AudioError, load_audio
from app.api.formats import to_srt, to_verbose_json, to_vtt
from app.api.types import (
    FALLBACK_TEMPERATURES,
    DecodingOptions,
    InvalidRequestError,
    TimestampMode,
    Transcription,
)
from app.engine.build import build_engine
from app.engine.engine import Engine
from app.settings import Settings


def _options(args: argparse.Namespace) -> DecodingOptions:
    timestamps: TimestampMode = args.timestamps or (
        "segment" if args.format in ("srt", "vtt", "verbose_json") else "none"
    )
    return DecodingOptions(
        language=args.language,
        task=args.task,
        use_assistant=not args.no_assistant,
        timestamps=timestamps,
        prompt=args.prompt,
        temperature=FALLBACK_TEMPERATURES if args.fallback else args.temperature,
        beam_size=args.beam_size,
        patience=args.patience,
        length_penalty=args.length_penalty,
        best_of=args.best_of,
    )


def _render(path: Path, result: Transcription, args: argparse.Namespace) -> str:
    if args.format == "text":
        return result.text
    if args.format == "srt":
        return to_srt(result)
    if args.format == "vtt":
        return to_vtt(result)
    if args.format == "verbose_json":
        body = to_verbose_json(result, args.task, words=args.timestamps == "word")
    else:
        body = {
            "text": result.text,
            "tokens": result.tokens,
            "language": result.language,
            "language_probability": result.language_probability,
            "finish": result.finish,
        }
    body = {"file": str(path), **body, "metrics": result.metrics.to_dict()}
    return json.dumps(body, ensure_ascii=False)


def run_transcribe(args: argparse.Namespace, settings: Settings) -> int:
    try:
        options = _options(args)
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = build_engine(settings, progress=args.verbose)
    failures = 0
    loaded: list[tuple[Path, np.ndarray]] = []
    for path in args.files:
        try:
            loaded.append((path, load_audio(path)))
        except (OSError, AudioError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            failures += 1
    groups = [loaded] if args.batch else [[item] for item in loaded]
    for group in groups:
        if not group:
            continue
        try:
            results = _transcribe(engine, [audio for _, audio in group], options)
        except InvalidRequestError as exc:
            print(f"error: {', '.join(str(p) for p, _ in group)}: {exc}", file=sys.stderr)
            failures += len(group)
            continue
        for (path, _), result in zip(group, results, strict=True):
            print(_render(path, result, args), flush=True)
    return 1 if failures else 0


def _transcribe(engine: Engine, audio: list[np.ndarray], options: DecodingOptions) -> list[Transcription]:
    """Up to 4 clips share a batch; more are split into batches of 4."""
    results: list[Transcription] = []
    for start in range(0, len(audio), 4):
        chunk = audio[start : start + 4]
        results += engine.transcribe(chunk, [options] * len(chunk))
    return results
