"""`python -m app transcribe`."""

from __future__ import annotations

import argparse
import json
import sys

from app.audio import AudioError, load_audio
from app.engine.transcriber import DecodingOptions, InvalidRequestError
from app.runtime import build_engine
from app.settings import Settings


def run_transcribe(args: argparse.Namespace, settings: Settings) -> int:
    try:
        options = DecodingOptions(language=args.language, task=args.task, use_assistant=not args.no_assistant)
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = build_engine(settings, progress=args.verbose)
    failures = 0
    for path in args.files:
        try:
            audio = load_audio(path)
            result = engine.transcribe([audio], [options])[0]
        except (OSError, AudioError, InvalidRequestError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            failures += 1
            continue
        if args.format == "json":
            record = {
                "file": str(path),
                "text": result.text,
                "tokens": result.tokens,
                "language": result.language,
                "language_probability": result.language_probability,
                "finish": result.finish,
                "metrics": result.metrics.to_dict(),
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            print(result.text, flush=True)
    return 1 if failures else 0
