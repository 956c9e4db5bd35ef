"""The engine: audio -> log-mel -> 30-s windows -> encoder -> (draft +) decoding -> segments, words, metrics.

Each request follows OpenAI's sequential long-form algorithm (`app.engine.longform`: seek, segments,
conditioning, temperature fallback). A batch advances all its requests one window at a time, so every
request of a batch shares each encoder and decoder pass; the decoding loop (`app.engine.generate`)
runs with the engine's drafter, if any, for the rows that ask for it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
import torch

from app.api.audio import SAMPLE_RATE
from app.api.types import DecodingOptions, InvalidRequestError, Segment, Transcription
from app.engine.alignment import align_words
from app.engine.decoding.batch import Row
from app.engine.decoding.logits import whisper_rules
from app.engine.decoding.search import BeamOptions, BeamSearch, Decoded, Greedy, Search, best_of
from app.engine.drafting.base import Drafter, DraftInputs
from app.engine.generate import decode, detect_language
from app.engine.invariance import checked_batch_invariance
from app.engine.longform import SAMPLE_LEN, LongFormJob
from app.model.decoder import CrossKV
from app.model.features import INPUT_STRIDE
from app.model.whisper import WhisperModel


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tone() -> np.ndarray:
    """One second of a 220-Hz tone: what the warm-up decodes."""
    t = np.arange(SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE
    return (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


class _AllCancelled(Exception):
    """Every clip of the window being decoded was cancelled: the window stops where it is."""


def _stopping(
    heartbeat: Callable[[], None] | None,
    cancelled: Callable[[int], bool] | None,
    jobs: list[LongFormJob],
    active: list[LongFormJob],
) -> Callable[[], None] | None:
    """The heartbeat of one window: `heartbeat()`, then a stop (`_AllCancelled`) once every active clip is
    cancelled."""
    if cancelled is None:
        return heartbeat
    indices = [jobs.index(job) for job in active]

    def beat() -> None:
        if heartbeat is not None:
            heartbeat()
        if all(cancelled(i) for i in indices):
            raise _AllCancelled

    return beat


class Engine:
    """A resident main model with an optional drafter; transcribes batches of clips of any length."""

    def __init__(self, main: WhisperModel, drafter: Drafter | None = None, seed: int = 0) -> None:
        self.main = main
        self.drafter = drafter
        self.seed = seed  # with a window's place and temperature, keys what a sampling row draws
        self._rules = {ts: whisper_rules(main, timestamps=ts) for ts in (False, True)}
        # Whether the main decoder gives a token the same bits however a pass feeds it, as checked on
        # this machine by `warm_up` (None until then).
        self.batch_invariant: bool | None = None

    def describe(self) -> dict[str, str | int | bool | None]:
        """What this engine runs: its models, device, torch threads and dtypes ("int8" for int8 linear layers), the
        encoder's attention kernel (timed now if the encoder has not run yet), the decoders' attention, whether the
        warm-up found the main decoder batch-invariant (`app.engine.invariance`), how the main decoder holds its
        weights ("float16" where its products read fp16 weights on the kernel, `app.model.halflinear`) and the
        instruction set of the int8 kernel (None where neither the main model nor the draft runs on it)."""
        from app.model.halflinear import holds_half
        from app.model.int8 import holds_int8
        from app.model.native import kernel_isa

        main, encoder = self.main, self.main.encoder
        draft_decoder = getattr(self.drafter, "decoder", None)
        on_kernel = any(holds_int8(m) for m in (main.decoder, encoder, draft_decoder))
        dtype = "int8" if holds_int8(main.decoder) else _dtype_name(main.dtype)
        return {
            "model": main.name,
            "assistant": self.drafter.name if self.drafter is not None else None,
            "device": str(main.device),
            "threads": torch.get_num_threads(),
            "dtype": dtype,
            "decoder_weights": "float16" if holds_half(main.decoder) else dtype,
            "encoder_dtype": None if encoder is None else "int8" if holds_int8(encoder) else _dtype_name(encoder.dtype),
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
        "cancelled", and the rest of the batch goes on without it. Within a window it is asked at each
        heartbeat: once every clip still running is cancelled, the window stops there (between two encoder
        layers or two decoder passes) and so does the batch, so that a batch nobody waits for any more
        (a live partial that a finished utterance made room for) frees the worker at once.
        heartbeat() is called at least once a window and after each encoder layer and main-model
        pass, so that a supervisor can tell slow work from a hang (it must be cheap).
        """
        if not audio or len(audio) != len(options):
            raise InvalidRequestError("need one set of options per clip, and at least one clip")
        for clip, opt in zip(audio, options, strict=True):
            self.check(opt, clip)
        started = time.perf_counter()
        jobs = [self.start(a, o) for a, o in zip(audio, options, strict=True)]
        self.advance(jobs, on_segments=on_segments, cancelled=cancelled, heartbeat=heartbeat)
        total = time.perf_counter() - started
        return [self.finish(job, total, len(jobs)) for job in jobs]

    def start(self, audio: np.ndarray, options: DecodingOptions) -> LongFormJob:
        """A clip's transcription, before its first window (its log-mel computed); `check` it first."""
        with torch.inference_mode():
            return self._job(audio, options)

    def advance(
        self,
        jobs: Sequence[LongFormJob],
        windows: int | None = None,
        on_segments: Callable[[int, list[Segment]], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        """Decode the jobs' windows together, each pass shared, until all are done or `windows` windows have run
        (then the jobs not done can go on in a later call, with others: the rows are batch-invariant, so where a
        job is cut changes none of its tokens). The callbacks are `transcribe`'s, `i` the job's index here."""
        jobs = list(jobs)
        with torch.inference_mode():
            for _ in itertools.count() if windows is None else range(windows):
                if cancelled is not None:
                    for i, job in enumerate(jobs):
                        if not job.done and cancelled(i):
                            job.cancel()
                active = [job for job in jobs if not job.done]
                if not active:
                    break
                before = [len(job.segments) for job in active]
                try:
                    self._window(active, batch=len(jobs), heartbeat=_stopping(heartbeat, cancelled, jobs, active))
                except _AllCancelled:
                    for job in active:
                        job.cancel()
                    break
                if on_segments is not None:
                    for job, n in zip(active, before, strict=True):
                        if len(job.segments) > n:
                            on_segments(jobs.index(job), job.segments[n:])

    def finish(self, job: LongFormJob, total_s: float, batch: int) -> Transcription:
        """A job's transcription, once `done`: `total_s` its time in the engine, `batch` its last batch's size."""
        return job.result(total_s, batch, speculative=self._speculative(job))

    def warm_up(self, batch_sizes: Iterable[int], *, check: bool = True) -> frozenset[int]:
        """Decode one second of a tone in each mode at each of `batch_sizes`; returns the sizes warmed.

        First calls pay one-off costs (thread pools, kernel set-up, allocator growth, wider caches),
        and the decoder pays them again at each new batch width: a first speculative batch of four
        ran three times slower than the next. Paid here, they no longer fall on the first requests.
        The encoder runs once, alone, and wider batches decode copies of its output: its own first
        batch of four took only 0.25 s (6%) longer than the next, while each batch-of-four pass of
        warm-up had cost ~4.5 s on a 2-core machine.

        Then (unless `check` is False: a warm-up that measures, and is followed by another) it checks whether the
        main decoder is batch-invariant here at the widest of `batch_sizes` (`check_batch_invariance`), and loads
        the tokens' byte table.
        """
        tone = _tone()
        sizes = frozenset(batch_sizes)
        with torch.inference_mode():
            first = self._job(tone, DecodingOptions(language="en"))
            features = first.features().unsqueeze(0)
            encoder_out = self.main.encode(features)
            for batch in sorted(sizes):
                wide_features = features.expand(batch, -1, -1).contiguous()
                wide_states = encoder_out.expand(batch, -1, -1).contiguous()
                inputs = self._inputs(wide_features, wide_states, first.segment_frames)
                for use in (True, False) if self.drafter is not None else (False,):
                    options = DecodingOptions(language="en", use_assistant=use)
                    jobs = [self._job(tone, options) for _ in range(batch)]
                    self._decode(jobs, [0.0] * batch, inputs, list(range(batch)))
            if check:
                self.check_batch_invariance(encoder_out, rows=max(sizes))
        # Each answer's token log-probabilities carry the tokens' bytes, from the tokenizer's byte table: built
        # here, not during the first request.
        self.main.tokenizer.token_bytes(self.main.tokenizer.encode(" a")[0])
        return sizes

    def check_batch_invariance(self, encoder_out: torch.Tensor | None = None, rows: int = 4) -> bool | None:
        """Check whether the main decoder gives a token the same bits however a pass of up to `rows` rows
        feeds it, on this machine (`app.engine.invariance`); logs and keeps the answer (`batch_invariant`,
        `describe()`). A check that fails to run is logged and leaves None: it is a diagnosis, not a
        reason to stop serving.

        encoder_out: one window's encoder states [1, 1500, D] to read (default: a second of a tone's).
        """

        def states() -> torch.Tensor:
            if encoder_out is not None:
                return encoder_out
            return self.main.encode(self._job(_tone(), DecodingOptions(language="en")).features()[None])

        self.batch_invariant = checked_batch_invariance(self.main, states, rows)
        return self.batch_invariant

    def _inputs(self, features: torch.Tensor, encoder_out: torch.Tensor, segment_frames: int) -> DraftInputs:
        """A window's cross-attention K/V and what its drafter gets, for its longest row's mel frames."""
        cross = self.main.decoder.cross_kv(encoder_out)
        return DraftInputs(features, encoder_out, cross, audio_frames=-(-segment_frames // INPUT_STRIDE))

    # -- one window of every active job --------------------------------------------------------
    def _window(self, jobs: list[LongFormJob], batch: int, heartbeat: Callable[[], None] | None = None) -> None:
        t0 = time.perf_counter()
        if heartbeat is not None:
            heartbeat()
        features = torch.stack([job.features() for job in jobs])
        encoded = self.main.encode(features, between_layers=heartbeat)
        session_inputs = self._inputs(features, encoded, max(job.segment_frames for job in jobs))
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
            decoded = self._decode([jobs[i] for i in pending], temps, session_inputs, pending, heartbeat)
            retry = []
            for i, d, t in zip(pending, decoded, temps, strict=True):
                jobs[i].counters.decoding.add(d.stats)
                results[i] = (d, t)
                if jobs[i].needs_fallback(d):
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
        jobs: list[LongFormJob],
        temps: list[float],
        inputs: DraftInputs,
        rows: list[int],
        heartbeat: Callable[[], None] | None = None,
    ) -> list[Decoded]:
        """Decode jobs[k] at temps[k]; its audio is row rows[k] of the window's `inputs`."""
        searches: list[Search] = []
        audio: list[int] = []
        owner: list[int] = []
        for k, (job, t) in enumerate(zip(jobs, temps, strict=True)):
            for search in self._searches(job, t):
                searches.append(search)
                audio.append(rows[k])
                owner.append(k)
        cross, session = inputs.main_cross, None
        if self.drafter is not None and any(s.rows[0].draft for s in searches):
            if audio != list(range(inputs.features.shape[0])):  # the draft reads one entry per search
                index = torch.tensor(audio)
                inputs = replace(
                    inputs,
                    features=inputs.features.index_select(0, index),
                    encoder_out=inputs.encoder_out.index_select(0, index),
                    main_cross=inputs.main_cross.rows(audio),
                )
            capacity = max(s.rows[0].max_len for s in searches)
            session = self.drafter.start(replace(inputs, capacity=capacity))
        decoded = decode(self.main, cross, audio, searches, session, heartbeat)
        out = []
        for k, job in enumerate(jobs):
            mine = [d for d, o in zip(decoded, owner, strict=True) if o == k]
            out.append(mine[0] if len(mine) == 1 else best_of(mine, job.options.length_penalty))
        return out

    def _searches(self, job: LongFormJob, temperature: float) -> list[Search]:
        """How a window of `job` decodes at `temperature`: beam search at 0 with beam_size above 1, else greedy
        decoding; above 0, `candidates` samples (each with its own noise) of which the best ranked is kept."""
        opts = job.options
        if temperature == 0 and opts.beam_size > 1:
            options = BeamOptions(opts.beam_size, opts.patience, opts.length_penalty)
            return [BeamSearch.start(self._row(job, temperature), options)]
        n = opts.candidates if temperature > 0 else 1
        return [Greedy(self._row(job, temperature, candidate=c)) for c in range(n)]

    def _row(self, job: LongFormJob, temperature: float, candidate: int = 0, draft: bool = True) -> Row:
        tok = self.main.tokenizer
        prompt: list[int] = []
        context = job.context()
        if context:
            prompt = [tok.sot_prev, *context[-(self.main.max_positions // 2 - 1) :]]
        sot_index = len(prompt)
        prompt += tok.prompt(job.language, job.options.task, timestamps=job.with_timestamps)
        new_tokens = job.options.max_new_tokens or SAMPLE_LEN
        key = (self.seed, job.seek, temperature) if candidate == 0 else (self.seed, job.seek, temperature, candidate)
        return Row(
            tokens=prompt,
            prompt_len=len(prompt),
            rules=self._rules[job.with_timestamps],
            max_len=min(self.main.max_positions, len(prompt) + new_tokens),
            eot=tok.eot,
            draft=draft and self._speculative(job),
            temperature=temperature,
            seed=hash(key),
            sot_index=sot_index,
        )

    def _job(self, audio: np.ndarray, options: DecodingOptions) -> LongFormJob:
        return LongFormJob(audio, options, self.main.tokenizer, self.main.n_mels)

    def _speculative(self, job: LongFormJob) -> bool:
        return self.drafter is not None and job.options.use_assistant

    def _consume(self, job: LongFormJob, d: Decoded, temperature: float, cross: CrossKV, row: int) -> None:
        """Row `row` of the window's batch (`cross`: the batch's keys/values) into the job's segments, with their
        words when the request aligns them."""
        frames = job.segment_frames
        window = job.begin(d, temperature)
        if window is None:
            return
        if job.aligns_words:
            timings = []
            text = job.text_tokens(window)
            if text:  # only word alignment reads the audio again: a view of the row's entry, not a copy (~37 MB)
                sot_sequence = self.main.tokenizer.prompt(job.language, job.options.task, timestamps=True)
                row_cross = cross.entry(cross.owner(row), 1)
                timings = align_words(self.main, row_cross, sot_sequence, text, frames, job.language)
            if not job.place_words(window, timings):
                return
        job.commit(window)
