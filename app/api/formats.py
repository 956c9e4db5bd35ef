"""Transcript output formats shared by the CLI and the API: text, json, verbose_json, srt, vtt."""

from __future__ import annotations

from typing import Any

from app.api.languages import LANGUAGES
from app.api.types import Transcription

FORMATS = ("text", "json", "verbose_json", "srt", "vtt")


def _clock(seconds: float, decimal: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def to_srt(result: Transcription) -> str:
    blocks = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(result.segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(result: Transcription) -> str:
    cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in result.segments]
    return "WEBVTT\n\n" + "\n".join(cues)


def language_name(code: str | None) -> str | None:
    """A language code's name, as OpenAI's `verbose_json` gives it: "en" -> "english"."""
    return None if code is None else LANGUAGES.get(code, code)


def to_verbose_json(result: Transcription, task: str, words: bool) -> dict[str, Any]:
    """OpenAI's `verbose_json` shape."""
    body: dict[str, Any] = {
        "task": task,
        "language": language_name(result.language),
        "duration": result.duration,
        "text": result.text,
        "segments": [
            {
                "id": s.id,
                "seek": s.seek,
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": round(s.avg_logprob, 6),
                "compression_ratio": round(s.compression_ratio, 6),
                "no_speech_prob": round(s.no_speech_prob, 6),
            }
            for s in result.segments
        ],
    }
    if words:
        body["words"] = [
            {"word": w.word.strip(), "start": w.start, "end": w.end, "probability": w.probability} for w in result.words
        ]
    return body
