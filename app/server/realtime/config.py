"""Session configuration of a realtime transcription session, read from either API shape.

Beta (`transcription_session.update`):
    {"input_audio_format": "pcm16", "input_audio_transcription": {"model", "language", "prompt"},
     "turn_detection": {"type": "server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms"} | null}
GA (`session.update`, `"type": "transcription"`):
    {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": {...},
                         "turn_detection": {...} | null}}}
pcm16 is 24 kHz in both; 16 kHz is accepted too (GA `rate`, or beta `input_audio_sample_rate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from app.api.types import InvalidRequestError
from app.server.vad import VadParams, server_vad

SAMPLE_RATES = (16000, 24000)


@dataclass(frozen=True)
class SessionConfig:
    model: str = "whisper-1"
    language: str | None = None
    prompt: str | None = None
    sample_rate: int = 24000
    vad: VadParams | None = field(default_factory=VadParams)  # None: the client commits turns itself

    def beta(self, session_id: str) -> dict[str, Any]:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": "pcm16",
            "input_audio_sample_rate": self.sample_rate,
            "input_audio_transcription": {"model": self.model, "language": self.language, "prompt": self.prompt},
            "turn_detection": _vad_out(self.vad),
        }

    def ga(self, session_id: str) -> dict[str, Any]:
        return {
            "id": session_id,
            "object": "realtime.session",
            "type": "transcription",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.sample_rate},
                    "transcription": {"model": self.model, "language": self.language, "prompt": self.prompt},
                    "turn_detection": _vad_out(self.vad),
                }
            },
        }


def _vad_out(vad: VadParams | None) -> dict[str, Any] | None:
    return None if vad is None else {"type": "server_vad", **vad.to_dict()}


def _obj(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object", param)
    return value


def _transcription(config: SessionConfig, raw: Any, param: str) -> SessionConfig:
    if raw is None:
        return config
    raw = _obj(raw, param)
    for key in ("model", "language", "prompt"):
        if key in raw and raw[key] is not None and not isinstance(raw[key], str):
            raise InvalidRequestError(f"{param}.{key} must be a string", f"{param}.{key}")
    return replace(
        config,
        model=raw.get("model") or config.model,
        language=raw.get("language", config.language) or None,
        prompt=raw.get("prompt", config.prompt) or None,
    )


def apply_update(config: SessionConfig, session: Any) -> SessionConfig:
    """The config after a `transcription_session.update` or `session.update`; InvalidRequestError (naming the
    field) if it is invalid."""
    session = _obj(session, "session")
    audio = session.get("audio")
    if audio is not None:  # GA shape
        inp = _obj(_obj(audio, "session.audio").get("input") or {}, "session.audio.input")
        fmt = inp.get("format")
        if fmt is not None:
            fmt = _obj(fmt, "session.audio.input.format")
            if fmt.get("type", "audio/pcm") != "audio/pcm":
                raise InvalidRequestError("only audio/pcm input is supported", "session.audio.input.format.type")
            config = _rate(config, fmt.get("rate", 24000), "session.audio.input.format.rate")
        config = _transcription(config, inp.get("transcription"), "session.audio.input.transcription")
        if "turn_detection" in inp:
            config = replace(
                config, vad=server_vad(inp["turn_detection"], "session.audio.input.turn_detection", config.vad)
            )
        return config
    fmt = session.get("input_audio_format")
    if fmt is not None and fmt != "pcm16":
        raise InvalidRequestError(
            f"input_audio_format {fmt!r} is not supported; use 'pcm16'", "session.input_audio_format"
        )
    if "input_audio_sample_rate" in session:
        config = _rate(config, session["input_audio_sample_rate"], "session.input_audio_sample_rate")
    config = _transcription(config, session.get("input_audio_transcription"), "session.input_audio_transcription")
    if "turn_detection" in session:
        config = replace(config, vad=server_vad(session["turn_detection"], "session.turn_detection", config.vad))
    return config


def _rate(config: SessionConfig, rate: Any, param: str) -> SessionConfig:
    if rate not in SAMPLE_RATES or isinstance(rate, bool):
        raise InvalidRequestError(f"sample rate must be one of {SAMPLE_RATES}", param)
    return replace(config, sample_rate=int(rate))
