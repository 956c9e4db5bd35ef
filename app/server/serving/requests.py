"""What an upload asks for: its form fields (`TranscriptionRequest`) and their validation into the engine's options
and the chunking (`RequestRules`); every invalid field is an ApiError that names it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app.api import errors
from app.api.formats import FORMATS
from app.api.types import FALLBACK_TEMPERATURES, DecodingOptions, InvalidRequestError
from app.server.serving.models import ModelNames
from app.server.serving.speakers import SpeakerAsk
from app.server.serving.uploads import AUTO_VAD, UPLOAD_VAD, Chunking
from app.server.vad import server_vad
from app.settings import Settings


@dataclass(frozen=True)
class TranscriptionRequest:
    """The form fields of `/v1/audio/transcriptions` and `/translations`, as received."""

    data: bytes
    filename: str | None
    content_type: str | None
    model: str
    task: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    timestamp_granularities: tuple[str, ...] = ()
    speculative: bool = True
    stream: bool = False
    # "auto", "none", a `server_vad` object, or its JSON; None: as the operator's `default_chunking_strategy`
    chunking_strategy: str | dict[str, Any] | None = None
    # openai-whisper's transcribe() options, beam search's included (OpenAI's API has none of them), as sent
    long_form: dict[str, str] = field(default_factory=dict)
    include: tuple[str, ...] = ()  # "logprobs": each text token's log-probability in the answer
    # who spoke: known speakers (names, and reference audio as data URLs), bounds on their number (form fields
    # `min_speakers`/`max_speakers`, as sent), and verbose_json's `diarize`
    known_speaker_names: tuple[str, ...] = ()
    known_speaker_references: tuple[str, ...] = ()
    speaker_bounds: dict[str, str] = field(default_factory=dict)
    diarize: bool = False

    @property
    def logprobs(self) -> bool:
        return "logprobs" in self.include

    @property
    def diarized(self) -> bool:
        """Whether the answer says who spoke: diarized_json, or verbose_json with `diarize=true`."""
        return self.response_format == "diarized_json" or self.diarize


# openai-whisper's `transcribe()` options an upload may set (form fields of the same names).
LONG_FORM_FIELDS = (
    "condition_on_previous_text",
    "compression_ratio_threshold",
    "logprob_threshold",
    "no_speech_threshold",
    "hallucination_silence_threshold",
    "clip_timestamps",
    "beam_size",
    "best_of",
    "patience",
    "length_penalty",
)
_INTEGER_FIELDS = ("beam_size", "best_of")


def _long_form(raw: dict[str, str]) -> dict[str, Any]:
    """The `transcribe()` options of an upload's form fields; ApiError naming the field if one is invalid.
    A threshold of "none" (or "null") turns that check off."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        text = value.strip()
        try:
            if name == "condition_on_previous_text":
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[name] = text.lower() in ("true", "1")
            elif name == "clip_timestamps":
                out[name] = tuple(float(t) for t in text.split(",") if t.strip())
            elif name in _INTEGER_FIELDS:
                out[name] = int(text)
            elif text.lower() in ("none", "null"):
                out[name] = None
            else:
                out[name] = float(text)
                if not np.isfinite(out[name]):
                    raise ValueError
        except ValueError:
            kind = {"condition_on_previous_text": "true or false", "clip_timestamps": "comma-separated seconds"}
            kind |= dict.fromkeys(_INTEGER_FIELDS, "a whole number")
            raise errors.bad_request(
                f"{name} must be {kind.get(name, 'a number or none')}, got {value[:40]!r}", param=name
            ) from None
    return out


class RequestRules:
    """The operator's settings applied to a request's fields."""

    def __init__(self, settings: Settings, models: ModelNames) -> None:
        self.settings = settings
        self.models = models

    def options(self, req: TranscriptionRequest) -> DecodingOptions:
        self.models.check(req.model)
        formats = (*FORMATS, "diarized_json") if req.task == "transcribe" else FORMATS
        if req.response_format not in formats:
            raise errors.bad_request(f"response_format must be one of {', '.join(formats)}", param="response_format")
        granularities = set(req.timestamp_granularities)
        self._check_diarized(req)
        if not granularities <= {"segment", "word"}:
            raise errors.bad_request(
                "timestamp_granularities must be 'segment' and/or 'word'", param="timestamp_granularities[]"
            )
        if req.stream and (granularities or req.response_format not in ("json", "text", "diarized_json")):
            raise errors.bad_request(
                "stream=true streams text: use response_format json, text or diarized_json, without timestamps",
                param="stream",
            )
        if not set(req.include) <= {"logprobs"}:
            raise errors.bad_request("include[] may only be 'logprobs'", param="include[]")
        if req.logprobs and req.response_format not in ("json", "verbose_json"):
            raise errors.bad_request(
                "include[]=logprobs needs response_format json (or verbose_json)", param="include[]"
            )
        if granularities and req.response_format != "verbose_json":
            raise errors.bad_request(
                "timestamp_granularities requires response_format=verbose_json", param="timestamp_granularities[]"
            )
        timestamps = "word" if "word" in granularities else "none"
        if timestamps == "none" and req.response_format in ("srt", "vtt", "verbose_json"):
            timestamps = "segment"
        options = self.decoding_options(
            req.task, req.language, req.prompt, req.temperature, timestamps, req.speculative
        )
        # temperature 0 means OpenAI's fallback: greedy first, then hotter while a window fails the thresholds
        ladder = FALLBACK_TEMPERATURES if req.temperature == 0 else (req.temperature,)
        decoding = {"beam_size": self.settings.default_beam_size} | _long_form(req.long_form)
        if req.diarized:  # its words get speakers: aligned after decoding, so the text is the json answer's
            decoding["word_times"] = True
        try:
            return replace(options, temperature=ladder, **decoding)
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc), param=exc.param) from exc

    def _check_diarized(self, req: TranscriptionRequest) -> None:
        """The fields a diarized answer refuses, or that only it takes."""
        if req.diarize and req.response_format not in ("verbose_json", "diarized_json"):
            raise errors.bad_request("diarize=true needs response_format verbose_json", param="diarize")
        if req.response_format == "diarized_json" and req.timestamp_granularities:
            raise errors.bad_request(
                "timestamp_granularities is not supported with response_format diarized_json",
                param="timestamp_granularities[]",
            )
        if req.response_format == "diarized_json" and req.logprobs:
            raise errors.bad_request("include[]=logprobs is not supported with diarized_json", param="include[]")
        sent = [
            name
            for name, value in (
                ("known_speaker_names[]", req.known_speaker_names),
                ("known_speaker_references[]", req.known_speaker_references),
            )
            if value
        ]
        sent += list(req.speaker_bounds)
        if sent and not req.diarized:
            raise errors.bad_request(
                f"{sent[0]} needs response_format diarized_json (or verbose_json with diarize=true)", param=sent[0]
            )

    def speakers(self, req: TranscriptionRequest) -> SpeakerAsk | None:
        """A diarized request's speaker fields, checked (ApiError naming the field); None for any other request."""
        if not req.diarized:
            return None
        return SpeakerAsk.parse(req.known_speaker_names, req.known_speaker_references, req.speaker_bounds)

    def chunking(self, req: TranscriptionRequest) -> Chunking | None:
        """The request's `chunking_strategy` (else the operator's default); ApiError if it is invalid."""
        raw = req.chunking_strategy if req.chunking_strategy is not None else self.settings.default_chunking_strategy
        if req.diarized and raw == "none":
            if req.chunking_strategy is not None:
                raise errors.bad_request(
                    "a diarized answer needs chunking_strategy 'auto' or a server_vad object: its speakers are told"
                    " apart over the speech the VAD finds",
                    param="chunking_strategy",
                )
            raw = "auto"  # what a diarized request gets when it sends none (OpenAI asks for one over 30 s)
        if isinstance(raw, str) and raw.strip().startswith("{"):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise errors.bad_request(
                    f"chunking_strategy is not valid JSON: {exc}", param="chunking_strategy"
                ) from exc
        if raw == "none":
            return None
        if "clip_timestamps" in req.long_form:  # times of the upload, which chunks do not keep
            raise errors.bad_request(
                "clip_timestamps cannot be combined with chunking_strategy", param="clip_timestamps"
            )
        if raw == "auto":
            return Chunking(AUTO_VAD, normalize=True)
        if not isinstance(raw, dict):
            raise errors.bad_request(
                "chunking_strategy must be 'auto', 'none' or a server_vad object", param="chunking_strategy"
            )
        try:
            params = server_vad(raw, "chunking_strategy", UPLOAD_VAD)
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc), param=exc.param) from exc
        assert params is not None
        return Chunking(params, normalize=False)

    def decoding_options(
        self,
        task: str,
        language: str | None,
        prompt: str | None,
        temperature: float = 0.0,
        timestamps: str = "none",
        speculative: bool = True,
    ) -> DecodingOptions:
        """The engine's options for a request of either kind (upload or live), its model checked already;
        ApiError if they are invalid."""
        if not 0.0 <= temperature <= 1.0:
            raise errors.bad_request("temperature must be between 0 and 1", param="temperature")
        language = language.strip().lower() if language else None
        try:
            return DecodingOptions(
                language=language or None,
                task=task,
                use_assistant=speculative,
                timestamps=timestamps,  # type: ignore[arg-type]
                prompt=prompt or None,
                temperature=temperature,
            )
        except InvalidRequestError as exc:
            raise errors.bad_request(str(exc)) from exc

    def live_options(self, model: str, language: str | None, prompt: str | None) -> DecodingOptions:
        """Options of a live transcription: greedy, no timestamps; ApiError if they are invalid."""
        self.models.check(model)
        return self.decoding_options("transcribe", language, prompt)
