"""The engine: audio -> log-mel -> encoder -> (draft +) greedy decoding -> text with metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from app.audio import SAMPLE_RATE
from app.engine.batch import Row
from app.engine.decoding import Decoded, decode, detect_language
from app.engine.draft import Drafter, DraftInputs
from app.engine.model import WhisperModel
from app.engine.tokenizer import TASKS

WINDOW_SECONDS = 30


class InvalidRequestError(ValueError):
    """The request's options or audio cannot be served by this engine."""


@dataclass(frozen=True)
class DecodingOptions:
    """Per-request decoding options, validated when built."""

    language: str | None = None
    task: str = "transcribe"
    use_assistant: bool = True
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be at least 1")
        if self.language is not None and not self.language.isascii():
            raise InvalidRequestError(f"unknown language {self.language!r}")


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

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


@dataclass(frozen=True)
class Transcription:
    text: str
    tokens: list[int]
    language: str | None
    language_probability: float | None
    finish: str
    metrics: Metrics


class Engine:
    """A resident main model with an optional drafter; transcribes batches of up to 30-s clips."""

    def __init__(self, main: WhisperModel, drafter: Drafter | None = None) -> None:
        from transformers import WhisperFeatureExtractor

        self.main = main
        self.drafter = drafter
        self.features = WhisperFeatureExtractor(feature_size=main.n_mels)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    def _check(self, options: DecodingOptions) -> None:
        tok = self.main.tokenizer
        known = options.language is None or options.language in tok.language_ids
        if not known and (tok.multilingual or options.language != "en"):
            raise InvalidRequestError(f"unsupported language {options.language!r} for {self.main.name}")
        if options.task == "translate" and not tok.multilingual:
            raise InvalidRequestError(f"{self.main.name} is English-only and cannot translate")

    def _log_mel(self, audio: Sequence[np.ndarray]) -> torch.Tensor:
        batch = self.features(
            [a.astype(np.float32) for a in audio], sampling_rate=SAMPLE_RATE, return_tensors="pt"
        )
        return batch.input_features

    def _rows(self, options: Sequence[DecodingOptions], languages: Sequence[str | None]) -> list[Row]:
        tok = self.main.tokenizer
        rows = []
        for opt, language in zip(options, languages, strict=True):
            prompt = tok.prompt(language, opt.task)
            max_len = self.main.max_positions
            if opt.max_new_tokens is not None:
                max_len = min(max_len, len(prompt) + opt.max_new_tokens)
            rows.append(Row(prompt, len(prompt), self.main.logit_rules(), max_len, tok.eot))
        return rows

    def transcribe(
        self, audio: Sequence[np.ndarray], options: Sequence[DecodingOptions]
    ) -> list[Transcription]:
        """Transcribe a batch of 16-kHz mono clips (each at most 30 s) as one batch."""
        if not audio or len(audio) != len(options):
            raise InvalidRequestError("need one set of options per clip, and at least one clip")
        for clip, opt in zip(audio, options, strict=True):
            if clip.size == 0:
                raise InvalidRequestError("empty audio")
            if clip.size > WINDOW_SECONDS * SAMPLE_RATE:
                raise InvalidRequestError(f"clips longer than {WINDOW_SECONDS} s need long-form decoding")
            self._check(opt)
        with torch.inference_mode():
            return self._transcribe(audio, options)

    def _transcribe(
        self, audio: Sequence[np.ndarray], options: Sequence[DecodingOptions]
    ) -> list[Transcription]:
        t0 = time.perf_counter()
        features = self._log_mel(audio)
        encoder_out = self.main.encode(features)
        cross = self.main.decoder.cross_kv(encoder_out)
        use_draft = self.drafter is not None and any(o.use_assistant for o in options)
        session = None
        if use_draft:
            assert self.drafter is not None
            session = self.drafter.start(DraftInputs(features, encoder_out, cross))
        t1 = time.perf_counter()

        tok = self.main.tokenizer
        languages: list[str | None] = [o.language for o in options]
        probabilities: list[float | None] = [None] * len(options)
        if tok.multilingual and any(lang is None for lang in languages):
            for i, (code, p) in enumerate(detect_language(self.main, cross)):
                if languages[i] is None:
                    languages[i], probabilities[i] = code, p
        rows = self._rows(options, languages)
        if session is not None:
            # Rows that opted out of the assistant get no draft budget.
            for row, opt in zip(rows, options, strict=True):
                row.draft = opt.use_assistant
        decoded = decode(self.main, cross, rows, session)
        t2 = time.perf_counter()
        return [
            self._result(d, audio[i], languages[i], probabilities[i], options[i], (t0, t1, t2), len(audio))
            for i, d in enumerate(decoded)
        ]

    def _result(
        self,
        decoded: Decoded,
        audio: np.ndarray,
        language: str | None,
        probability: float | None,
        options: DecodingOptions,
        times: tuple[float, float, float],
        batch: int,
    ) -> Transcription:
        t0, t1, t2 = times
        seconds = audio.size / SAMPLE_RATE
        s = decoded.stats
        total_ms = (t2 - t0) * 1000
        speculative = self.drafter is not None and options.use_assistant
        metrics = Metrics(
            audio_seconds=round(seconds, 3),
            encode_ms=round((t1 - t0) * 1000, 2),
            decode_ms=round((t2 - t1) * 1000, 2),
            total_ms=round(total_ms, 2),
            tokens=len(decoded.tokens),
            draft_proposed=s.drafted,
            draft_accepted=s.accepted,
            acceptance_rate=round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
            main_passes=s.main_passes,
            draft_passes=s.draft_passes,
            tokens_per_main_pass=round(len(decoded.tokens) / s.main_passes, 3) if s.main_passes else 0.0,
            real_time_factor=round(total_ms / 1000 / seconds, 4) if seconds else 0.0,
            speculative=speculative,
            batch_size=batch,
        )
        text = self.main.tokenizer.decode(decoded.tokens).strip()
        return Transcription(text, decoded.tokens, language, probability, decoded.finish, metrics)
