"""OpenAI's sequential long-form algorithm, one request at a time: where a request stands in its audio.

A request's audio is cut into 30-s windows. Each decoded window (with timestamp tokens) is cut into
segments at timestamp pairs; the request then seeks to the end of its last complete segment (or past
the window when it ended on a single timestamp or had none), conditions its next window on the text
so far, and retries a window at a higher temperature when its text is too repetitive or too
unlikely, unless the window is silence. `Engine` advances a batch of these one window at a time.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from app.api.audio import SAMPLE_RATE
from app.api.types import DecodingOptions, Metrics, Segment, Transcription, Word
from app.engine.generate import Decoded, RowStats
from app.model.features import FRAMES_PER_SECOND, INPUT_STRIDE, N_FRAMES, N_SAMPLES, TIME_PRECISION, log_mel, window
from app.model.tokenizer import WhisperTokenizer

SAMPLE_LEN = 224  # new tokens per window (OpenAI: n_text_ctx // 2)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class Counters:
    """A request's totals over its windows (and fallback attempts)."""

    decoding: RowStats = field(default_factory=RowStats)
    encode_s: float = 0.0
    decode_s: float = 0.0
    windows: int = 0
    tokens: int = 0


class LongFormJob:
    """One request's progress through its windows: the seek, the text so far, its segments and counters."""

    def __init__(self, audio: np.ndarray, options: DecodingOptions, tokenizer: WhisperTokenizer, n_mels: int) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.duration = audio.size / SAMPLE_RATE
        self.mel = log_mel(audio, n_mels, padding=N_SAMPLES)
        self.content_frames = self.mel.shape[-1] - N_FRAMES
        # Timestamp tokens drive the seek of long audio; short audio honours the request.
        self.with_timestamps = options.timestamps != "none" or self.content_frames > N_FRAMES
        self.seek = 0
        self.language: str | None = options.language
        self.language_probability: float | None = None
        self.all_tokens: list[int] = tokenizer.encode(" " + options.prompt.strip()) if options.prompt else []
        self.prompt_reset = 0
        self.segments: list[Segment] = []
        self.finish = "stop"
        self.counters = Counters()

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    def cancel(self) -> None:
        self.seek = self.content_frames
        self.finish = "cancelled"

    @property
    def segment_frames(self) -> int:
        """Mel frames of the current window (30 s, or what is left)."""
        return min(N_FRAMES, self.content_frames - self.seek)

    @property
    def offset(self) -> float:
        """Where the current window starts in the audio, in seconds."""
        return self.seek / FRAMES_PER_SECOND

    def features(self) -> torch.Tensor:
        """The current window's log-mel features [n_mels, 3000]."""
        return window(self.mel, self.seek, self.segment_frames)

    def context(self) -> list[int]:
        """The previous text this window is conditioned on."""
        return self.all_tokens[self.prompt_reset :] if self.options.condition_on_previous_text else []

    def _silent(self, d: Decoded, ignore_logprob: bool = False) -> bool:
        opts = self.options
        return (
            opts.no_speech_threshold is not None
            and d.no_speech_prob is not None
            and d.no_speech_prob > opts.no_speech_threshold
            and (ignore_logprob or not (opts.logprob_threshold is not None and d.avg_logprob > opts.logprob_threshold))
        )

    def needs_fallback(self, d: Decoded) -> bool:
        """Whether a window decoded at one temperature should be decoded again at the next one."""
        opts = self.options
        ratio = compression_ratio(self.tokenizer.decode(d.tokens))
        repetitive = opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold
        low_logprob = opts.logprob_threshold is not None and d.avg_logprob < opts.logprob_threshold
        return (repetitive or low_logprob) and not (self._silent(d, ignore_logprob=True) and low_logprob)

    def consume(self, d: Decoded, temperature: float) -> int | None:
        """Turn the current window's decoded tokens into segments and seek past them.

        Returns the index of the first segment this window added (the length of `segments` when it
        added none), or None when the window was skipped as silence.
        """
        tok = self.tokenizer
        size = self.segment_frames
        offset = self.offset
        if d.finish == "length":
            self.finish = "length"
        if self._silent(d):  # whatever the timestamp mode, as in OpenAI's transcribe(): no text made up over noise
            self.seek += size
            return None
        tokens = d.tokens
        tb = tok.timestamp_begin
        is_ts = [t >= tb for t in tokens]
        spans: list[tuple[float, float, list[int]]] = []
        single_ending = is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        if cuts:
            last = 0
            for cut in cuts + ([len(tokens)] if single_ending else []):
                part = tokens[last:cut]
                start, end = (offset + (part[k] - tb) * TIME_PRECISION for k in (0, -1))
                spans.append((start, end, part))
                last = cut
            if single_ending:
                self.seek += size
            else:
                self.seek += (tokens[last - 1] - tb) * INPUT_STRIDE
        else:
            duration = size / FRAMES_PER_SECOND
            stamps = [t for t in tokens if t >= tb]
            if stamps and stamps[-1] != tb:
                duration = (stamps[-1] - tb) * TIME_PRECISION
            spans.append((offset, offset + duration, tokens))
            self.seek += size
        self.counters.tokens += len(tokens)
        ratio = compression_ratio(tok.decode(tokens))  # of the whole window, as OpenAI reports it
        first_new = len(self.segments)
        for start, end, part in spans:
            text = tok.decode([t for t in part if t < tok.eot])
            if not text.strip():
                continue
            self.segments.append(
                Segment(
                    id=len(self.segments),
                    seek=int(offset * FRAMES_PER_SECOND),
                    start=round(start, 3),
                    end=round(end, 3),
                    text=text,
                    tokens=part,
                    temperature=temperature,
                    avg_logprob=d.avg_logprob,
                    compression_ratio=ratio,
                    no_speech_prob=d.no_speech_prob or 0.0,
                )
            )
        self.all_tokens.extend(t for _, _, part in spans for t in part)
        if not self.options.condition_on_previous_text or temperature > 0.5:
            self.prompt_reset = len(self.all_tokens)
        return first_new

    def text_tokens(self, first: int) -> list[int]:
        """The text tokens (no timestamps, no end) of the segments from index `first` on."""
        eot = self.tokenizer.eot
        return [t for s in self.segments[first:] for t in s.tokens if t < eot]

    def attach_words(self, words: list[Word], first: int, offset: float) -> None:
        """Give the segments from index `first` on their words (aligned over those segments' text tokens,
        with times relative to the window that starts at `offset` seconds)."""
        eot = self.tokenizer.eot
        cursor = 0
        for k, seg in enumerate(self.segments[first:], start=first):
            n = len([t for t in seg.tokens if t < eot])
            mine, used = [], 0
            while cursor < len(words) and used < n:
                w = words[cursor]
                mine.append(Word(w.word, round(w.start + offset, 3), round(w.end + offset, 3), w.probability, w.tokens))
                used += len(w.tokens)
                cursor += 1
            self.segments[k] = replace(seg, words=mine)

    def result(self, total_s: float, batch: int, speculative: bool) -> Transcription:
        c = self.counters
        s = c.decoding
        n_tokens = c.tokens
        metrics = Metrics(
            audio_seconds=round(self.duration, 3),
            encode_ms=round(c.encode_s * 1000, 2),
            decode_ms=round(c.decode_s * 1000, 2),
            total_ms=round(total_s * 1000, 2),
            tokens=n_tokens,
            draft_proposed=s.drafted,
            draft_accepted=s.accepted,
            acceptance_rate=round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
            main_passes=s.main_passes,
            draft_passes=s.draft_passes,
            tokens_per_main_pass=round(n_tokens / s.main_passes, 3) if s.main_passes else 0.0,
            real_time_factor=round(total_s / self.duration, 4) if self.duration else 0.0,
            speculative=speculative,
            batch_size=batch,
            windows=c.windows,
        )
        return Transcription(
            text="".join(seg.text for seg in self.segments).strip(),
            tokens=[t for seg in self.segments for t in seg.tokens],
            language=self.language,
            language_probability=self.language_probability,
            duration=round(self.duration, 3),
            segments=self.segments,
            finish=self.finish,
            metrics=metrics,
        )
