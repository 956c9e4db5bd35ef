"""Session configuration of a realtime transcription session, read from either API shape.

Beta (`transcription_session.update`):
    {"input_audio_format": "pcm16" | "g711_ulaw" | "g711_alaw",
     "input_audio_transcription": {"model", "language", "prompt", "languages", "keywords", "delay", "diarize"},
     "turn_detection": {"type": "server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms"}
                     | {"type": "semantic_vad", "eagerness": "low" | "medium" | "high" | "auto"} | null,
     "input_audio_noise_reduction": {"type": "near_field" | "far_field"} | null}
GA (`session.update`, `"type": "transcription"`):
    {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000} | {"type": "audio/pcmu" | "audio/pcma"},
                         "transcription": {...}, "turn_detection": {...} | null,
                         "noise_reduction": {"type": ...} | null}}}
pcm16 is 24 kHz in both (16 kHz is accepted too: GA `rate`, or beta `input_audio_sample_rate`); G.711 is 8 kHz.
A field either shape does not define is refused, naming it, as OpenAI refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from app.api.audio import G711_RATE
from app.api.types import InvalidRequestError, hinted_language, hinted_prompt
from app.server.realtime.turns import TurnDetection, describe, turn_detection
from app.server.vad import VadParams

SAMPLE_RATES = (16000, 24000)
FORMATS = ("pcm16", "g711_ulaw", "g711_alaw")  # the beta names; the GA ones below
GA_FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
DELAYS = ("minimal", "low", "medium", "high", "xhigh")
NOISE_REDUCTION = ("near_field", "far_field")
LOGPROBS = "item.input_audio_transcription.logprobs"  # deltas and completed events carry the tokens' logprobs
PARTIALS = "item.input_audio_transcription.partials"  # ours: hypotheses of the open turn (`partials.py`)
# Fields a client may send back as it received them (the session's own): accepted, and ignored.
ECHOED = frozenset({"id", "object", "expires_at"})
BETA_FIELDS = frozenset(
    {"input_audio_format", "input_audio_sample_rate", "input_audio_transcription", "turn_detection"}
    | {"input_audio_noise_reduction", "include", "modalities"}
)
GA_FIELDS = frozenset({"type", "audio", "include"})


@dataclass(frozen=True)
class SessionConfig:
    model: str = "whisper-1"
    language: str | None = None
    prompt: str | None = None
    languages: tuple[str, ...] = ()  # gpt-transcribe's expected languages: one is the language, more are detected
    keywords: tuple[str, ...] = ()  # words to spell as given: they join the prompt
    delay: str | None = None  # gpt-realtime-whisper's latency knob: accepted and echoed (turns end by the VAD)
    audio_format: str = "pcm16"  # one of FORMATS
    sample_rate: int = 24000  # pcm16's; G.711 is always 8 kHz
    turn_detection: TurnDetection | None = field(default_factory=VadParams)  # None: the client commits turns
    noise_reduction: str | None = None  # accepted and echoed; no suppressor runs (measured: docs/performance.md)
    logprobs: bool = False  # `include`s LOGPROBS
    diarize: bool = False  # ours: each completed turn says which of the session's voices spoke it (`speaker`)
    partials: bool = False  # `include`s PARTIALS

    @property
    def rate(self) -> int:
        """The input audio's sample rate."""
        return self.sample_rate if self.audio_format == "pcm16" else G711_RATE

    @property
    def decoding_language(self) -> str | None:
        """The language Whisper is told (None: it detects it)."""
        return hinted_language(self.language, self.languages)

    @property
    def decoding_prompt(self) -> str | None:
        """Whisper's prompt: the client's, then its keywords."""
        return hinted_prompt(self.prompt, self.keywords)

    def _transcription(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "language": self.language, "prompt": self.prompt}
        optional: dict[str, Any] = {"languages": list(self.languages), "keywords": list(self.keywords)}
        optional |= {"delay": self.delay, "diarize": self.diarize}
        return out | {k: v for k, v in optional.items() if v}

    def _noise(self) -> dict[str, Any] | None:
        return None if self.noise_reduction is None else {"type": self.noise_reduction}

    def _include(self) -> list[str]:
        return [name for name, on in ((LOGPROBS, self.logprobs), (PARTIALS, self.partials)) if on]

    def beta(self, session_id: str) -> dict[str, Any]:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": self.audio_format,
            "input_audio_sample_rate": self.rate,
            "input_audio_transcription": self._transcription(),
            "turn_detection": describe(self.turn_detection),
            "input_audio_noise_reduction": self._noise(),
            "include": self._include(),
        }

    def ga(self, session_id: str) -> dict[str, Any]:
        ga_type = next(k for k, v in GA_FORMATS.items() if v == self.audio_format)
        fmt: dict[str, Any] = {"type": ga_type, "rate": self.rate}
        return {
            "id": session_id,
            "object": "realtime.session",
            "type": "transcription",
            "audio": {
                "input": {
                    "format": fmt,
                    "transcription": self._transcription(),
                    "turn_detection": describe(self.turn_detection),
                    "noise_reduction": self._noise(),
                }
            },
            "include": self._include(),
        }


def _obj(value: Any, param: str, known: frozenset[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object", param)
    if known is not None:
        for key in value:
            if key not in known:
                raise InvalidRequestError(f"Unknown parameter: '{param}.{str(key)[:64]}'.", f"{param}.{str(key)[:64]}")
    return value


def _transcription(config: SessionConfig, raw: Any, param: str) -> SessionConfig:
    if raw is None:
        return config
    raw = _obj(raw, param, frozenset({"model", "language", "prompt", "languages", "keywords", "delay", "diarize"}))
    for key in ("model", "language", "prompt", "delay"):
        if key in raw and raw[key] is not None and not isinstance(raw[key], str):
            raise InvalidRequestError(f"{param}.{key} must be a string", f"{param}.{key}")
    for key in ("languages", "keywords"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(x, str) for x in value)):
            raise InvalidRequestError(f"{param}.{key} must be a list of strings", f"{param}.{key}")
    if raw.get("diarize") is not None and not isinstance(raw["diarize"], bool):
        raise InvalidRequestError(f"{param}.diarize must be true or false", f"{param}.diarize")
    if raw.get("delay") is not None and raw["delay"] not in DELAYS:
        raise InvalidRequestError(f"{param}.delay must be one of {', '.join(DELAYS)}", f"{param}.delay")
    return replace(
        config,
        model=raw.get("model") or config.model,
        language=raw.get("language", config.language) or None,
        prompt=raw.get("prompt", config.prompt) or None,
        languages=tuple(raw.get("languages", config.languages) or ()),
        keywords=tuple(raw.get("keywords", config.keywords) or ()),
        delay=raw.get("delay", config.delay) or None,
        diarize=bool(raw.get("diarize", config.diarize)),
    )


def _noise_reduction(config: SessionConfig, raw: Any, param: str) -> SessionConfig:
    if raw is None:
        return replace(config, noise_reduction=None)
    kind = _obj(raw, param, frozenset({"type"})).get("type")
    if kind not in NOISE_REDUCTION:
        raise InvalidRequestError(f"{param}.type must be one of {', '.join(NOISE_REDUCTION)}", f"{param}.type")
    return replace(config, noise_reduction=kind)


def _include(config: SessionConfig, raw: Any, param: str) -> SessionConfig:
    if raw is None:
        return replace(config, logprobs=False, partials=False)
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise InvalidRequestError(f"{param} must be a list of strings", param)
    for value in raw:
        if value not in (LOGPROBS, PARTIALS):
            raise InvalidRequestError(
                f"{param}: {value[:64]!r} is not supported; only {LOGPROBS!r}, {PARTIALS!r}", param
            )
    return replace(config, logprobs=LOGPROBS in raw, partials=PARTIALS in raw)


def apply_update(config: SessionConfig, session: Any) -> SessionConfig:
    """The config after a `transcription_session.update` or `session.update`; InvalidRequestError (naming the
    field) if it is invalid."""
    session = _obj(session, "session")
    if "audio" in session or "type" in session:  # GA shape
        return _apply_ga(config, _obj(session, "session", GA_FIELDS | ECHOED))
    session = _obj(session, "session", BETA_FIELDS | ECHOED)
    fmt = session.get("input_audio_format")
    if fmt is not None:
        if fmt not in FORMATS:
            raise InvalidRequestError(
                f"input_audio_format must be one of {', '.join(FORMATS)}", "session.input_audio_format"
            )
        config = replace(config, audio_format=fmt)
    if "input_audio_sample_rate" in session:
        if config.audio_format != "pcm16" and session["input_audio_sample_rate"] != G711_RATE:
            raise InvalidRequestError("G.711 audio is 8000 Hz", "session.input_audio_sample_rate")
        if config.audio_format == "pcm16":
            config = _rate(config, session["input_audio_sample_rate"], "session.input_audio_sample_rate")
    config = _transcription(config, session.get("input_audio_transcription"), "session.input_audio_transcription")
    if "turn_detection" in session:
        detection = turn_detection(session["turn_detection"], "session.turn_detection", config.turn_detection)
        config = replace(config, turn_detection=detection)
    if "input_audio_noise_reduction" in session:
        config = _noise_reduction(config, session["input_audio_noise_reduction"], "session.input_audio_noise_reduction")
    if "include" in session:
        config = _include(config, session["include"], "session.include")
    modalities = session.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequestError("a transcription session's modalities are ['text']", "session.modalities")
    return config


def _apply_ga(config: SessionConfig, session: dict[str, Any]) -> SessionConfig:
    if session.get("type", "transcription") != "transcription":
        raise InvalidRequestError(
            "this server runs transcription sessions: session.type must be 'transcription'", "session.type"
        )
    if "include" in session:
        config = _include(config, session["include"], "session.include")
    audio = _obj(session.get("audio") or {}, "session.audio", frozenset({"input"}))
    inp = _obj(audio.get("input") or {}, "session.audio.input")
    _obj(inp, "session.audio.input", frozenset({"format", "transcription", "turn_detection", "noise_reduction"}))
    fmt = inp.get("format")
    if fmt is not None:
        fmt = _obj(fmt, "session.audio.input.format", frozenset({"type", "rate"}))
        kind = GA_FORMATS.get(fmt.get("type", "audio/pcm"))
        if kind is None:
            raise InvalidRequestError(
                f"session.audio.input.format.type must be one of {', '.join(GA_FORMATS)}",
                "session.audio.input.format.type",
            )
        config = replace(config, audio_format=kind)
        if kind == "pcm16":
            config = _rate(config, fmt.get("rate", 24000), "session.audio.input.format.rate")
        elif fmt.get("rate", G711_RATE) != G711_RATE:
            raise InvalidRequestError("G.711 audio is 8000 Hz", "session.audio.input.format.rate")
    config = _transcription(config, inp.get("transcription"), "session.audio.input.transcription")
    if "turn_detection" in inp:
        param = "session.audio.input.turn_detection"
        config = replace(config, turn_detection=turn_detection(inp["turn_detection"], param, config.turn_detection))
    if "noise_reduction" in inp:
        config = _noise_reduction(config, inp["noise_reduction"], "session.audio.input.noise_reduction")
    return config


def _rate(config: SessionConfig, rate: Any, param: str) -> SessionConfig:
    if rate not in SAMPLE_RATES or isinstance(rate, bool):
        raise InvalidRequestError(f"sample rate must be one of {SAMPLE_RATES}", param)
    return replace(config, sample_rate=int(rate))
