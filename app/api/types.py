"""The engine's interface: the options a request brings and the results it gets, as plain data.

The web process builds and reads these without loading the engine: nothing here imports torch (only the
worker process holds the models).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class Word:
    """A word of a segment with its times (s) and probability, from word-level alignment."""

    word: str
    start: float
    end: float
    probability: float
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A text token of the transcript with its log-probability (OpenAI's `logprobs` entry): `token` is its text,
    `bytes` its UTF-8 bytes (a token may hold part of a character)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": round(self.logprob, 6), "bytes": list(self.bytes)}


TimestampMode = Literal["none", "segment", "word"]
TIMESTAMP_MODES: tuple[str, ...] = ("none", "segment", "word")
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
MAX_BEAM = 16  # the most hypotheses (beam_size) or samples (best_of) a request may ask for


class InvalidRequestError(ValueError):
    """The request's options or audio cannot be served; `param` names the field at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def hinted_language(language: str | None, languages: Sequence[str]) -> str | None:
    """The language Whisper is told, from OpenAI's `language` or the newer models' `languages` (the languages the
    audio may be in): one is that language; several, or none, leave it to detection."""
    return language or (languages[0] if len(languages) == 1 else None)


def hinted_prompt(prompt: str | None, keywords: Sequence[str]) -> str | None:
    """Whisper's prompt, from OpenAI's `prompt` and the newer models' `keywords`: the keywords follow the prompt,
    so that Whisper spells those words as the prompt does."""
    return " ".join(p for p in (prompt, ", ".join(keywords)) if p) or None


@dataclass(frozen=True)
class DecodingOptions:
    """Per-request decoding options, validated when built.

    temperature: one value, or a ladder tried in order when a window fails the
    compression-ratio / log-probability checks (OpenAI's fallback). 0 is greedy, or beam search with
    `beam_size` > 1; above 0 each window samples `best_of` candidates and keeps the best ranked.

    Beam search is openai-whisper's: `beam_size` hypotheses, finished ones collected until there are
    round(beam_size * patience), ranked by summed log-probability over length (`length_penalty` None)
    or over Google NMT's ((5 + length) / 6) ** length_penalty. best_of None: beam_size (as openai-whisper's
    and faster-whisper's command lines pair them), so 1 for greedy decoding.
    """

    language: str | None = None
    task: str = "transcribe"
    use_assistant: bool = True
    timestamps: TimestampMode = "none"
    prompt: str | None = None
    temperature: float | tuple[float, ...] = 0.0
    condition_on_previous_text: bool = True
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    max_new_tokens: int | None = None
    # seconds: start, end, start, end, ... of the parts to transcribe (the last end defaults to the audio's end)
    clip_timestamps: tuple[float, ...] = ()
    # with word alignment, skip silences longer than this (s) around words that look made up (OpenAI's option)
    hallucination_silence_threshold: float | None = None
    # align each window's words once it is decoded, changing nothing of the decoding (no timestamp tokens the
    # request would not have, no seek after the last word): the words a diarized answer gives speakers to
    word_times: bool = False
    beam_size: int = 1  # 1: greedy
    patience: float | None = None
    length_penalty: float | None = None
    best_of: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.timestamps not in TIMESTAMP_MODES:
            raise InvalidRequestError(f"timestamps must be one of {', '.join(TIMESTAMP_MODES)}")
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= 448:
            raise InvalidRequestError("max_new_tokens must be within 1..448")
        temps = self.temperatures
        if not temps or any(not 0.0 <= t <= 2.0 for t in temps):
            raise InvalidRequestError("temperature must be within 0..2")
        if self.language is not None and not self.language.isascii():
            raise InvalidRequestError(f"unknown language {self.language!r}")
        clips = self.clip_timestamps
        if any(not 0 <= t < 1e7 for t in clips) or any(a > b for a, b in itertools.pairwise(clips)):
            raise InvalidRequestError(
                "clip_timestamps must be non-decreasing non-negative seconds: start,end,start,end,...",
                "clip_timestamps",
            )
        for name in ("compression_ratio_threshold", "no_speech_threshold", "hallucination_silence_threshold"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1e6:
                raise InvalidRequestError(f"{name} must be a non-negative number", name)
        if self.logprob_threshold is not None and not -1e6 < self.logprob_threshold <= 0:
            raise InvalidRequestError("logprob_threshold must be a log-probability (at most 0)", "logprob_threshold")
        if not 1 <= self.beam_size <= MAX_BEAM:
            raise InvalidRequestError(f"beam_size must be within 1..{MAX_BEAM} (1: greedy)", "beam_size")
        if self.best_of is not None and not 1 <= self.best_of <= MAX_BEAM:
            raise InvalidRequestError(f"best_of must be within 1..{MAX_BEAM}", "best_of")
        if self.patience is not None:
            if self.beam_size == 1:
                raise InvalidRequestError("patience needs beam search (beam_size above 1)", "patience")
            if not 0 < self.patience <= 10 or round(self.beam_size * self.patience) < 1:
                raise InvalidRequestError("patience must be above 0 (at most 10) and keep one candidate", "patience")
        if self.length_penalty is not None and not 0 <= self.length_penalty <= 2:
            raise InvalidRequestError("length_penalty must be within 0..2", "length_penalty")

    @property
    def temperatures(self) -> tuple[float, ...]:
        t = self.temperature
        return (float(t),) if isinstance(t, (int, float)) else tuple(float(x) for x in t)

    @property
    def candidates(self) -> int:
        """How many samples a window decoded above temperature 0 draws (`best_of`, by default `beam_size`)."""
        return self.best_of if self.best_of is not None else self.beam_size

    @property
    def rows(self) -> int:
        """Rows of a decoding pass its first attempt takes: its beam's hypotheses (1 when greedy or sampling one)."""
        return self.beam_size if self.temperatures[0] == 0 else self.candidates

    @property
    def decoding(self) -> str:
        """What decodes a window at temperature 0: "greedy" or "beam"."""
        return "beam" if self.beam_size > 1 else "greedy"


@dataclass(frozen=True)
class Metrics:
    """Per-request measurements (times in milliseconds; batch-level times are shared by its rows)."""

    audio_seconds: float
    encode_ms: float
    decode_ms: float
    total_ms: float
    tokens: int
    draft_proposed: int
    draft_accepted: int
    acceptance_rate: float
    main_passes: int
    draft_passes: int
    tokens_per_main_pass: float
    real_time_factor: float
    speculative: bool
    batch_size: int
    windows: int
    decoding: str = "greedy"  # at temperature 0: "greedy" or "beam"
    beam_size: int = 1

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)

    @classmethod
    def none(cls, audio_seconds: float, total_ms: float) -> Metrics:
        """The measurements of work that decoded nothing (voice prints only)."""
        return cls(audio_seconds, 0.0, 0.0, total_ms, 0, 0, 0, 0.0, 0, 0, 0.0, 0.0, False, 1, 0)


@dataclass(frozen=True)
class Segment:
    """A span of text with its times (OpenAI `verbose_json` segment fields)."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of its text tokens


@dataclass(frozen=True)
class Voice:
    """A voice print: a speaker embedding (a unit vector, numpy float32) of the speech heard around a time, and the
    stretch of the clip (s) it speaks for. The worker takes them when a request asks who spoke."""

    start: float
    end: float
    vector: Any
    heard: float  # the speech the print heard (s): a piece shorter than the embedder's window gives a weaker one


@dataclass(frozen=True)
class Transcription:
    text: str
    tokens: list[int]
    language: str | None
    language_probability: float | None
    duration: float
    segments: list[Segment]
    finish: str
    metrics: Metrics
    voices: list[Voice] = field(default_factory=list)  # when the job asked for them (`Job.speakers`)

    @property
    def words(self) -> list[Word]:
        return [w for s in self.segments for w in s.words]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [p for s in self.segments for p in s.logprobs]
