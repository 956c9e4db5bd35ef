"""The engine: audio -> log-mel -> 30-s windows -> encoder -> (draft +) decoding -> segments, words, metrics.

Long audio follows OpenAI's sequential algorithm: decode a 30-s window with timestamp
tokens, cut it into segments at timestamp pairs, seek to the end of the last complete
segment, condition the next window on the text so far, and retry a window at higher
temperatures when its text is too repetitive or too unlikely. A batch advances all its
requests one window at a time, so every request of a batch shares each encoder and
decoder pass.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from app.api.audio import SAMPLE_RATE
from app.api.types import (
    DecodingOptions,
    InvalidRequestError,
    Metrics,
    Segment,
    Transcription,
    Word,
)
from app.engine.alignment import align_words
from app.engine.decoding.batch import Row
from app.engine.decoding.logits import whisper_rules
from app.engine.drafting.base import Drafter, DraftInputs
from app.engine.generate import Decoded, RowStats, decode, detect_language
from app.engine.invariance import decoder_is_batch_invariant
from app.model.decoder import CrossKV
from app.model.features import (
    FRAMES_PER_SECOND,
    INPUT_STRIDE,
    N_FRAMES,
    N_SAMPLES,
    TIME_PRECISION,
    log_mel,
    window,
)
from app.model.whisper import WhisperModel

log = logging.getLogger(__name__)

SAMPLE_LEN = 224  # tokens per window (OpenAI: n_text_ctx // 2)


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class _Counters:
    """A request's totals over its windows (and fallback attempts)."""

    decoding: RowStats = field(default_factory=RowStats)
    encode_s: float = 0.0
    decode_s: float = 0.0
    windows: int = 0
    tokens: int = 0


class _Job:
    """One request's progress through its windows."""

    def __init__(self, model: WhisperModel, audio: np.ndarray, options: DecodingOptions) -> None:
        self.options = options
        self.duration = audio.size / SAMPLE_RATE
        self.mel = log_mel(audio, model.n_mels, padding=N_SAMPLES)
        self.content_frames = self.mel.shape[-1] - N_FRAMES
        # Timestamp tokens drive the seek of long audio; short audio honours the request.
        self.with_timestamps = options.timestamps != "none" or self.content_frames > N_FRAMES
        self.seek = 0
        self.language: str | None = options.language
        self.language_probability: float | None = None
        tok = model.tokenizer
        self.all_tokens: list[int] = tok.encode(" " + options.prompt.strip()) if options.prompt else []
        self.prompt_reset = 0
        self.segments: list[Segment] = []
        self.finish = "stop"
        self.counters = _Counters()

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    def cancel(self) -> None:
        self.seek = self.content_frames
        self.finish = "cancelled"

    @property
    def segment_frames(self) -> int:
        return min(N_FRAMES, self.content_frames - self.seek)

    def features(self) -> torch.Tensor:
        return window(self.mel, self.seek, self.segment_frames)

    def context(self) -> list[int]:
        return self.all_tokens[self.prompt_reset :] if self.options.condition_on_previous_text else []


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tone() -> np.ndarray:
    """One second of a 220-Hz tone: what the warm-up decodes."""
    t = np.arange(SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE
    return (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


class Engine:
    """A resident main model with an optional drafter; transcribes batches of clips of any length."""

    def __init__(self, main: WhisperModel, drafter: Drafter | None = None, seed: int = 0) -> None:
        self.main = main
        self.drafter = drafter
        self.generator = torch.Generator().manual_seed(seed)
        self._rules = {ts: whisper_rules(main, timestamps=ts) for ts in (False, True)}
        # Whether the main decoder gives a token the same bits however a pass feeds it, as checked on
        # this machine by `warm_up` (None until then).
        self.batch_invariant: bool | None = None

    def describe(self) -> dict[str, str | int | bool | None]:
        """What this engine runs: its models, device, torch threads and dtypes, the encoder's attention
        kernel (timed now if the encoder has not run yet), the decoders' attention, whether the warm-up found
        the main decoder batch-invariant (`app.engine.invariance`) and the instruction set of the draft's
        int8 kernel (None where the draft does not run on it)."""
        from app.engine.drafting.int8 import Int8Linear
        from app.model.native import kernel_isa

        main, encoder = self.main, self.main.encoder
        draft_decoder = getattr(self.drafter, "decoder", None)
        on_kernel = draft_decoder is not None and any(isinstance(m, Int8Linear) for m in draft_decoder.modules())
        return {
            "model": main.name,
            "assistant": self.drafter.name if self.drafter is not None else None,
            "device": str(main.device),
            "threads": torch.get_num_threads(),
            "dtype": _dtype_name(main.dtype),
            "encoder_dtype": _dtype_name(encoder.dtype) if encoder is not None else None,
            "encoder_attention": encoder.attention_in_use() if encoder is not None else None,
            "decoder_attention": main.decoder.attention_in_use(),
            "batch_invariant": self.batch_invariant,
            "int8_kernel": kernel_isa() if on_kernel else None,
        }

    def check(self, options: DecodingOptions, audio: np.ndarray) -> None:
        """Raise InvalidRequestError if this clip cannot be transcribed with these options."""
        if audio.size == 0:
            raise InvalidRequestError("empty audio")
        tok = self.main.tokenizer
        known = options.language is None or options.language in tok.language_ids
        if not known and (tok.multilingual or options.language != "en"):
            raise InvalidRequestError(f"unsupported language {options.language!r} for {self.main.name}")
        if options.task == "translate" and not tok.multilingual:
            raise InvalidRequestError(f"{self.main.name} is English-only and cannot translate")

    def transcribe(
        self,
        audio: Sequence[np.ndarray],
        options: Sequence[DecodingOptions],
        on_segments: Callable[[int, list[Segment]], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> list[Transcription]:
        """Transcribe a batch of 16-kHz mono clips; every request of the batch shares each pass.

        on_segments(i, segments) is called after each window with the segments it added to clip i,
        so that a caller can stream long audio while it is being transcribed.
        cancelled(i) is asked before each window: clip i then stops where it is, with finish
        "cancelled", and the rest of the batch goes on without it.
        heartbeat() is called at least once a window and after each encoder run and main-model
        pass, so that a supervisor can tell slow work from a hang (it must be cheap).
        """
        if not audio or len(audio) != len(options):
            raise InvalidRequestError("need one set of options per clip, and at least one clip")
        for clip, opt in zip(audio, options, strict=True):
            self.check(opt, clip)
        started = time.perf_counter()
        with torch.inference_mode():
            jobs = [_Job(self.main, a, o) for a, o in zip(audio, options, strict=True)]
            while True:
                if cancelled is not None:
                    for i, job in enumerate(jobs):
                        if not job.done and cancelled(i):
                            job.cancel()
                active = [job for job in jobs if not job.done]
                if not active:
                    break
                before = [len(job.segments) for job in active]
                self._window(active, batch=len(jobs), heartbeat=heartbeat)
                if on_segments is not None:
                    for job, n in zip(active, before, strict=True):
                        if len(job.segments) > n:
                            on_segments(jobs.index(job), job.segments[n:])
        total = time.perf_counter() - started
        return [self._result(job, total, len(jobs)) for job in jobs]

    def warm_up(self, batch_sizes: Iterable[int]) -> frozenset[int]:
        """Decode one second of a tone in each mode at each of `batch_sizes`; returns the sizes warmed.

        First calls pay one-off costs (thread pools, kernel set-up, allocator growth, wider caches),
        and the decoder pays them again at each new batch width: a first speculative batch of four
        ran three times slower than the next. Paid here, they no longer fall on the first requests.
        The encoder runs once, alone, and wider batches decode copies of its output: its own first
        batch of four took only 0.25 s (6%) longer than the next, while each batch-of-four pass of
        warm-up had cost ~4.5 s on a 2-core machine.

        Then it checks whether the main decoder is batch-invariant here (`check_batch_invariance`).
        """
        tone = _tone()
        sizes = frozenset(batch_sizes)
        with torch.inference_mode():
            first = _Job(self.main, tone, DecodingOptions(language="en"))
            features = first.features().unsqueeze(0)
            encoder_out = self.main.encode(features)
            for batch in sorted(sizes):
                wide_features = features.expand(batch, -1, -1).contiguous()
                wide_states = encoder_out.expand(batch, -1, -1).contiguous()
                inputs = self._inputs(wide_features, wide_states, first.segment_frames)
                for use in (True, False) if self.drafter is not None else (False,):
                    options = DecodingOptions(language="en", use_assistant=use)
                    jobs = [_Job(self.main, tone, options) for _ in range(batch)]
                    self._decode(jobs, [0.0] * batch, inputs.main_cross, inputs, torch.arange(batch))
            self.check_batch_invariance(encoder_out, rows=max(sizes))
        return sizes

    def check_batch_invariance(self, encoder_out: torch.Tensor | None = None, rows: int = 4) -> bool | None:
        """Check whether the main decoder gives a token the same bits however a pass of up to `rows` rows
        feeds it, on this machine (`app.engine.invariance`); logs and keeps the answer (`batch_invariant`,
        `describe()`). A check that fails to run is logged and leaves None: it is a diagnosis, not a
        reason to stop serving.

        encoder_out: one window's encoder states [1, 1500, D] to read (default: a second of a tone's).
        """
        try:
            with torch.inference_mode():
                if encoder_out is None:
                    features = _Job(self.main, _tone(), DecodingOptions(language="en")).features()[None]
                    encoder_out = self.main.encode(features)
                prompt = self.main.tokenizer.prompt("en", "transcribe")
                cross = self.main.decoder.cross_kv(encoder_out)
                invariant = decoder_is_batch_invariant(self.main.decoder, cross, prompt, rows)
        except Exception:
            log.exception("could not check whether the main decoder is batch-invariant")
            self.batch_invariant = None
            return None
        attention = self.main.decoder.attention_in_use()
        if invariant:
            log.info("the main decoder is batch-invariant here: speculative output is main-only's bit for bit")
        else:
            # Expected with torch's attention (GPU, half precision, the sdpa setting); a surprise with ours.
            log.log(
                logging.WARNING if attention == "invariant" else logging.INFO,
                "the main decoder is not batch-invariant here (%s attention, %s): speculative output is"
                " main-only's token for token wherever no two logits are within rounding of each other",
                attention, _dtype_name(self.main.dtype),
            )  # fmt: skip
        self.batch_invariant = invariant
        return invariant

    def _inputs(self, features: torch.Tensor, encoder_out: torch.Tensor, segment_frames: int) -> DraftInputs:
        """A window's cross-attention K/V and what its drafter gets, for its longest row's mel frames."""
        cross = self.main.decoder.cross_kv(encoder_out)
        return DraftInputs(features, encoder_out, cross, audio_frames=-(-segment_frames // INPUT_STRIDE))

    # -- one window of every active job --------------------------------------------------------
    def _window(self, jobs: list[_Job], batch: int, heartbeat: Callable[[], None] | None = None) -> None:
        t0 = time.perf_counter()
        if heartbeat is not None:
            heartbeat()
        features = torch.stack([job.features() for job in jobs])
        session_inputs = self._inputs(features, self.main.encode(features), max(job.segment_frames for job in jobs))
        if heartbeat is not None:
            heartbeat()
        cross = session_inputs.main_cross
        t1 = time.perf_counter()
        tok = self.main.tokenizer
        undetected = [i for i, job in enumerate(jobs) if job.language is None]
        if tok.multilingual and undetected:
            detected = detect_language(self.main, cross.select(torch.tensor(undetected)))
            for i, (code, p) in zip(undetected, detected, strict=True):
                jobs[i].language, jobs[i].language_probability = code, p
        results: list[tuple[Decoded, float] | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))
        for attempt in range(max(len(job.options.temperatures) for job in jobs)):
            pending = [i for i in pending if attempt < len(jobs[i].options.temperatures)]
            if not pending:
                break
            temps = [jobs[i].options.temperatures[attempt] for i in pending]
            index = torch.tensor(pending)
            sub_cross = cross if len(pending) == len(jobs) else cross.select(index)
            decoded = self._decode([jobs[i] for i in pending], temps, sub_cross, session_inputs, index, heartbeat)
            retry = []
            for i, d, t in zip(pending, decoded, temps, strict=True):
                jobs[i].counters.decoding.add(d.stats)
                results[i] = (d, t)
                if self._needs_fallback(jobs[i].options, d):
                    retry.append(i)
            pending = retry
        t2 = time.perf_counter()
        for i, job in enumerate(jobs):
            result = results[i]
            assert result is not None
            self._consume(job, result[0], result[1], cross, i)
            job.counters.encode_s += t1 - t0
            job.counters.decode_s += t2 - t1
            job.counters.windows += 1

    def _decode(
        self,
        jobs: list[_Job],
        temps: list[float],
        cross: CrossKV,
        inputs: DraftInputs,
        index: torch.Tensor,
        heartbeat: Callable[[], None] | None = None,
    ) -> list[Decoded]:
        rows = [self._row(job, t) for job, t in zip(jobs, temps, strict=True)]
        session = None
        if self.drafter is not None and any(row.draft for row in rows):
            if len(jobs) != inputs.features.shape[0]:
                inputs = replace(
                    inputs,
                    features=inputs.features.index_select(0, index),
                    encoder_out=inputs.encoder_out.index_select(0, index),
                    main_cross=cross,
                )
            session = self.drafter.start(replace(inputs, capacity=max(row.max_len for row in rows)))
        return decode(self.main, cross, rows, session, self.generator, heartbeat)

    def _row(self, job: _Job, temperature: float) -> Row:
        tok = self.main.tokenizer
        prompt: list[int] = []
        context = job.context()
        if context:
            prompt = [tok.sot_prev, *context[-(self.main.max_positions // 2 - 1) :]]
        sot_index = len(prompt)
        prompt += tok.prompt(job.language, job.options.task, timestamps=job.with_timestamps)
        new_tokens = job.options.max_new_tokens or SAMPLE_LEN
        return Row(
            tokens=prompt,
            prompt_len=len(prompt),
            rules=self._rules[job.with_timestamps],
            max_len=min(self.main.max_positions, len(prompt) + new_tokens),
            eot=tok.eot,
            draft=self.drafter is not None and job.options.use_assistant,
            temperature=temperature,
            sot_index=sot_index,
        )

    def _needs_fallback(self, options: DecodingOptions, d: Decoded) -> bool:
        ratio = compression_ratio(self.main.tokenizer.decode(d.tokens))
        fallback = options.compression_ratio_threshold is not None and ratio > options.compression_ratio_threshold
        low_logprob = options.logprob_threshold is not None and d.avg_logprob < options.logprob_threshold
        silent = (
            options.no_speech_threshold is not None
            and d.no_speech_prob is not None
            and d.no_speech_prob > options.no_speech_threshold
        )
        return (fallback or low_logprob) and not (silent and low_logprob)

    # -- turning a decoded window into segments -------------------------------------------------
    def _consume(self, job: _Job, d: Decoded, temperature: float, cross: CrossKV, row: int) -> None:
        """Turn row `row` of the window's batch (`cross`: the batch's keys/values) into the job's segments."""
        tok = self.main.tokenizer
        opts = job.options
        size = job.segment_frames
        offset = job.seek / FRAMES_PER_SECOND
        if d.finish == "length":
            job.finish = "length"
        silent = (
            opts.no_speech_threshold is not None
            and d.no_speech_prob is not None
            and d.no_speech_prob > opts.no_speech_threshold
            and not (opts.logprob_threshold is not None and d.avg_logprob > opts.logprob_threshold)
        )
        if silent:  # whatever the timestamp mode, as in OpenAI's transcribe(): no text made up over noise
            job.seek += size
            return
        tokens = d.tokens
        tb = tok.timestamp_begin
        is_ts = [t >= tb for t in tokens]
        spans: list[tuple[float, float, list[int]]] = []
        single_ending = is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        if cuts:
            slices = cuts + ([len(tokens)] if single_ending else [])
            last = 0
            for cut in slices:
                part = tokens[last:cut]
                spans.append(
                    (
                        offset + (part[0] - tb) * TIME_PRECISION,
                        offset + (part[-1] - tb) * TIME_PRECISION,
                        part,
                    )
                )
                last = cut
            if single_ending:
                job.seek += size
            else:
                job.seek += (tokens[last - 1] - tb) * INPUT_STRIDE
        else:
            duration = size / FRAMES_PER_SECOND
            stamps = [t for t in tokens if t >= tb]
            if stamps and stamps[-1] != tb:
                duration = (stamps[-1] - tb) * TIME_PRECISION
            spans.append((offset, offset + duration, tokens))
            job.seek += size
        job.counters.tokens += len(tokens)
        ratio = compression_ratio(tok.decode(tokens))  # of the whole window, as OpenAI reports it
        before = len(job.segments)
        for start, end, part in spans:
            text_tokens = [t for t in part if t < tok.eot]
            text = tok.decode(text_tokens)
            if not text.strip():
                continue
            job.segments.append(
                Segment(
                    id=len(job.segments),
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
        if opts.timestamps == "word":
            # Only word alignment reads the audio again: one row's copy (~37 MB for base) only then.
            self._add_words(job, cross.select(torch.tensor([row])), size, offset, first_new=before)
        job.all_tokens.extend(t for _, _, part in spans for t in part)
        if not opts.condition_on_previous_text or temperature > 0.5:
            job.prompt_reset = len(job.all_tokens)

    def _add_words(self, job: _Job, cross: CrossKV, frames: int, offset: float, first_new: int) -> None:
        tok = self.main.tokenizer
        segments = job.segments[first_new:]
        text_tokens = [t for s in segments for t in s.tokens if t < tok.eot]
        sot_sequence = tok.prompt(job.language, job.options.task, timestamps=True)
        words = align_words(self.main, cross, sot_sequence, text_tokens, frames, job.language)
        cursor = 0
        for k, seg in enumerate(segments):
            n = len([t for t in seg.tokens if t < tok.eot])
            mine, used = [], 0
            while cursor < len(words) and used < n:
                w = words[cursor]
                mine.append(Word(w.word, round(w.start + offset, 3), round(w.end + offset, 3), w.probability, w.tokens))
                used += len(w.tokens)
                cursor += 1
            job.segments[first_new + k] = Segment(**{**seg.__dict__, "words": mine})

    def _result(self, job: _Job, total_s: float, batch: int) -> Transcription:
        c = job.counters
        s = c.decoding
        n_tokens = c.tokens
        total_ms = total_s * 1000
        metrics = Metrics(
            audio_seconds=round(job.duration, 3),
            encode_ms=round(c.encode_s * 1000, 2),
            decode_ms=round(c.decode_s * 1000, 2),
            total_ms=round(total_ms, 2),
            tokens=n_tokens,
            draft_proposed=s.drafted,
            draft_accepted=s.accepted,
            acceptance_rate=round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
            main_passes=s.main_passes,
            draft_passes=s.draft_passes,
            tokens_per_main_pass=round(n_tokens / s.main_passes, 3) if s.main_passes else 0.0,
            real_time_factor=round(total_s / job.duration, 4) if job.duration else 0.0,
            speculative=self.drafter is not None and job.options.use_assistant,
            batch_size=batch,
            windows=c.windows,
        )
        text = "".join(s.text for s in job.segments).strip()
        return Transcription(
            text=text,
            tokens=[t for s in job.segments for t in s.tokens],
            language=job.language,
            language_probability=job.language_probability,
            duration=round(job.duration, 3),
            segments=job.segments,
            finish=job.finish,
            metrics=metrics,
        )
