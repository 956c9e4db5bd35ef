"""OpenAI's sequential long-form algorithm (openai-whisper's `transcribe()`), one request at a time.

A request's audio (or each of its `clip_timestamps` clips) is cut into 30-s windows. Each decoded window
(with timestamp tokens) is cut into segments at timestamp pairs; the request then seeks to the end of its
last complete segment (or past the window when it ended on a single timestamp or had none), conditions its
next window on the text so far, and retries a window at a higher temperature when its text is too
repetitive or too unlikely, unless the window is silence. With word timestamps it seeks to the last word's
end instead, and `hallucination_silence_threshold` skips silence around words that look made up.
`Engine` advances a batch of these one window at a time: `begin` a window with its decoded tokens, give
its words (`place_words`) when the request aligns them, then `commit` it.

Every decision is the reference's, so the segments (text, tokens, times, log-probabilities, temperatures)
are the ones `transcribe()` gives on the same weights and options. Where this differs on purpose: times
are clamped to the end of the audio (the reference can place a segment's end past it), and segments
without text are left out (the reference keeps them, emptied).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from app.api.audio import SAMPLE_RATE
from app.api.types import DecodingOptions, Metrics, Segment, TokenLogprob, Transcription
from app.engine.alignment import WordTiming
from app.engine.decoding.search import Decoded, RowStats
from app.engine.wordtimes import WindowSegment, add_words, is_anomaly, last_end_of, with_words
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


@dataclass
class Window:
    """A decoded window: where it was, what it decoded and the segments it makes."""

    seek: int  # mel frames into the audio where it starts
    size: int  # its mel frames
    decoded: Decoded
    temperature: float
    segments: list[WindowSegment]
    single_ending: bool  # the tokens ended on one timestamp: no speech after it

    @property
    def offset(self) -> float:
        return self.seek / FRAMES_PER_SECOND

    @property
    def end_time(self) -> float:
        """Where a full 30-s window from here would end (s)."""
        return (self.seek + N_FRAMES) / FRAMES_PER_SECOND


class LongFormJob:
    """One request's progress through its windows: the seek, the text so far, its segments and counters."""

    def __init__(self, audio: np.ndarray, options: DecodingOptions, tokenizer: WhisperTokenizer, n_mels: int) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.duration = audio.size / SAMPLE_RATE
        self.mel = log_mel(audio, n_mels, padding=N_SAMPLES)
        self.content_frames = self.mel.shape[-1] - N_FRAMES
        # Words are aligned when asked for, or to look for hallucinations: then they steer the seek (OpenAI's
        # rules). `word_times` aligns them after the fact only, so the text is the one without words.
        self.seeks_by_words = options.timestamps == "word" or options.hallucination_silence_threshold is not None
        self.aligns_words = self.seeks_by_words or options.word_times
        # Timestamp tokens drive the seek of long audio; short audio honours the request.
        self.with_timestamps = options.timestamps != "none" or self.seeks_by_words or self.content_frames > N_FRAMES
        self.clips = self._clips(options.clip_timestamps)
        self.clip = 0
        self.seek = self.clips[0][0] if self.clips else 0
        self.language: str | None = options.language
        self.language_probability: float | None = None
        self.all_tokens: list[int] = tokenizer.encode(" " + options.prompt.strip()) if options.prompt else []
        self.prompt_reset = 0
        self.last_speech = 0.0  # where the last word ended (s)
        self.segments: list[Segment] = []
        self.finish = "stop"
        self.counters = Counters()
        self._settle()

    def _clips(self, stamps: tuple[float, ...]) -> list[tuple[int, int]]:
        """`clip_timestamps` (start, end, start, end, ... in seconds; the last end defaults to the end of the
        audio) as [start, end) mel frames, within the audio."""
        points = [round(t * FRAMES_PER_SECOND) for t in stamps] or [0]
        if len(points) % 2:
            points.append(self.content_frames)
        pairs = zip(points[::2], points[1::2], strict=True)
        return [(a, min(b, self.content_frames)) for a, b in pairs if a < min(b, self.content_frames)]

    def _settle(self) -> None:
        """Move the seek into the current clip, or on to the next clip when this one is done."""
        while self.clip < len(self.clips):
            start, end = self.clips[self.clip]
            self.seek = max(self.seek, start)
            if self.seek < end:
                return
            self.clip += 1
            if self.clip < len(self.clips):
                self.seek = self.clips[self.clip][0]

    @property
    def done(self) -> bool:
        return self.clip >= len(self.clips)

    def cancel(self) -> None:
        self.clip = len(self.clips)
        self.finish = "cancelled"

    @property
    def segment_frames(self) -> int:
        """Mel frames of the current window (30 s, or what is left of the audio or the clip)."""
        return min(N_FRAMES, self.content_frames - self.seek, self.clips[self.clip][1] - self.seek)

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

    def _compression_ratio(self, d: Decoded) -> float:
        """Of a decoded window's whole text, as OpenAI's decoder reports it."""
        return compression_ratio(self.tokenizer.decode(d.tokens).strip())

    def needs_fallback(self, d: Decoded) -> bool:
        """Whether a window decoded at one temperature should be decoded again at the next one."""
        opts = self.options
        ratio = self._compression_ratio(d)
        repetitive = opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold
        low_logprob = opts.logprob_threshold is not None and d.avg_logprob < opts.logprob_threshold
        return (repetitive or low_logprob) and not (self._silent(d, ignore_logprob=True) and low_logprob)

    # -- a window --------------------------------------------------------------------------------------
    def begin(self, d: Decoded, temperature: float) -> Window | None:
        """The current window's decoded tokens (at `temperature`, after any fallback) as segments; seeks past
        them. None when the window is skipped as silence."""
        size, seek = self.segment_frames, self.seek
        if d.finish == "length":
            self.finish = "length"
        if self._silent(d):  # whatever the timestamp mode, as in OpenAI's transcribe(): no text made up over noise
            self.seek += size
            self._settle()
            return None
        tok = self.tokenizer
        offset = seek / FRAMES_PER_SECOND
        tokens = d.tokens
        tb = tok.timestamp_begin
        is_ts = [t >= tb for t in tokens]
        single_ending = is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        segments: list[WindowSegment] = []

        def add(start: float, end: float, lo: int, hi: int) -> None:
            part = tokens[lo:hi]
            segments.append(WindowSegment(seek, start, end, part, tok.decode(part), d.logprobs[lo:hi]))

        if cuts:
            last = 0
            for cut in cuts + ([len(tokens)] if single_ending else []):
                first, final = tokens[last], tokens[cut - 1]
                add(offset + (first - tb) * TIME_PRECISION, offset + (final - tb) * TIME_PRECISION, last, cut)
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
            add(offset, offset + duration, 0, len(tokens))
            self.seek += size
        self.counters.tokens += len(tokens)
        return Window(seek, size, d, temperature, segments, single_ending)

    def text_tokens(self, window: Window) -> list[int]:
        """The window's text tokens (no timestamps, no end), the ones its words are aligned over."""
        eot = self.tokenizer.eot
        return [t for s in window.segments for t in s.tokens if t < eot]

    def place_words(self, window: Window, timings: list[WordTiming]) -> bool:
        """Give the window's segments their words (`timings`: aligned over `text_tokens(window)`, in seconds of
        the window) as OpenAI's `add_word_timestamps` does, then seek after the last word and, with
        `hallucination_silence_threshold`, skip silence around words that look made up. False when the whole
        window is to be dropped (it began with a likely hallucination after a long silence)."""
        add_words(window.segments, timings, window.offset, self.last_speech, self.tokenizer.eot)
        if not self.seeks_by_words:  # `word_times`: the words are told, the decoding goes on as without them
            return True
        segments, offset = window.segments, window.offset
        last_end = last_end_of(segments)
        if not window.single_ending and last_end is not None and last_end > offset:
            self.seek = round(last_end * FRAMES_PER_SECOND)
        threshold = self.options.hallucination_silence_threshold
        if threshold is not None:
            if not window.single_ending and last_end is not None and last_end > offset:
                remaining = window.end_time - last_end
                self.seek = round(last_end * FRAMES_PER_SECOND) if remaining > threshold else window.seek + window.size
            first = with_words(segments)
            if first is not None and is_anomaly(first):
                gap = first.start - offset
                if gap > threshold:
                    self.seek = window.seek + round(gap * FRAMES_PER_SECOND)
                    self._settle()
                    return False
            previous_end = self.last_speech
            for i, segment in enumerate(segments):
                if not segment.words:
                    continue
                if is_anomaly(segment):
                    following = with_words(segments[i + 1 :])
                    next_start = following.words[0].start if following is not None else offset + window.size / 100
                    silence_before = (
                        segment.start - previous_end > threshold
                        or segment.start < threshold
                        or segment.start - offset < 2.0
                    )
                    silence_after = (
                        next_start - segment.end > threshold
                        or is_anomaly(following)
                        or window.end_time - segment.end < 2.0
                    )
                    if silence_before and silence_after:
                        self.seek = round(max(offset + 1, segment.start) * FRAMES_PER_SECOND)
                        if self.content_frames / FRAMES_PER_SECOND - segment.end < threshold:
                            self.seek = self.content_frames
                        del segments[i:]
                        break
                previous_end = segment.end
        last_end = last_end_of(segments)
        if last_end is not None:
            self.last_speech = last_end
        return True

    def commit(self, window: Window) -> int:
        """Keep the window's segments (those with text and length), extend the text the next window is
        conditioned on, and move to where the next window starts. Returns the index of the first segment it
        added (the length of `segments` when it added none)."""
        d = window.decoded
        ratio = self._compression_ratio(d)
        first_new = len(self.segments)
        end = self.duration
        for s in window.segments:
            if s.start == s.end or not s.text.strip():  # emptied, as in the reference: no text, no tokens
                continue
            words = [replace(w, start=min(w.start, end), end=min(w.end, end)) for w in s.words]
            self.segments.append(
                Segment(
                    id=len(self.segments),
                    seek=s.seek,
                    start=round(min(s.start, end), 3),
                    end=round(min(s.end, end), 3),
                    text=s.text,
                    tokens=s.tokens,
                    temperature=window.temperature,
                    avg_logprob=d.avg_logprob,
                    compression_ratio=ratio,
                    no_speech_prob=d.no_speech_prob or 0.0,
                    words=words,
                    logprobs=self._text_logprobs(s),
                )
            )
            self.all_tokens.extend(s.tokens)
        if not self.options.condition_on_previous_text or window.temperature > 0.5:
            self.prompt_reset = len(self.all_tokens)
        self._settle()
        return first_new

    def _text_logprobs(self, s: WindowSegment) -> list[TokenLogprob]:
        """The segment's text tokens (no timestamps) with their log-probabilities, as OpenAI lists them."""
        out = []
        for token, logprob in zip(s.tokens, s.logprobs, strict=True):
            if token < self.tokenizer.eot:
                raw = self.tokenizer.token_bytes(token)
                out.append(TokenLogprob(raw.decode("utf-8", errors="replace"), logprob, tuple(raw)))
        return out

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
            decoding=self.options.decoding,
            beam_size=self.options.beam_size,
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
