"""The serving layer: the one service that uploads (REST, SSE) and live sessions (realtime) go through.

An upload is validated (`requests.py`), its audio read in bounded steps on the upload threads (`uploads.py`,
`admission.FairShare`), admitted to the budget of audio in flight (`admission.AudioBudget`), queued in its lane
(`jobs.py`), and its answer shaped and recorded (`replies.py`), whole or streamed (`streams.py`). Live sessions
go through `live` (`live.py`), over the same jobs.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, AudioTooLongError, EncodedAudio
from app.api.types import DecodingOptions, Transcription
from app.server.metrics import ServerMetrics
from app.server.serving.admission import Account, AudioBudget, FairShare, OverBudget
from app.server.serving.chunking import CHUNK_SECONDS, Chunk, Part, merge
from app.server.serving.jobs import Jobs
from app.server.serving.leveling import regions_in
from app.server.serving.live import LiveService
from app.server.serving.models import ModelNames
from app.server.serving.replies import Replies, Reply
from app.server.serving.requests import RequestRules, TranscriptionRequest
from app.server.serving.shortfall import written_in_full
from app.server.serving.speakers import SPEECH_VAD, SpeakerAsk, Speakers, prints_of
from app.server.serving.streams import HeldEvents, chunk_events, job_events
from app.server.serving.uploads import STEP_SAMPLES, AudioScan, Chunking, ChunkScan, chunk_results
from app.server.vad import SileroVad
from app.server.worker.client import EngineClient
from app.server.worker.protocol import Job
from app.settings import Settings
from app.speakers.diarization import Diarization, SpeakerRequest

T = TypeVar("T")

NON_AUDIO_TYPES = ("text/", "image/", "application/json", "application/xml", "application/pdf")
SHORT_UPLOAD_S = 60.0  # an upload this short passes uploads waiting for the audio budget, when it fits
SHORT_RESERVE_UPLOADS = 4  # short uploads' own room past the audio budget: this many of SHORT_UPLOAD_S


@dataclass(frozen=True)
class Upload:
    """An admitted upload: its bytes, its first pass (length, loudness) and its use of the upload threads."""

    audio: EncodedAudio
    scan: AudioScan
    account: Account

    @property
    def long(self) -> bool:
        """Longer than SHORT_UPLOAD_S: its jobs are `background`, a short upload's go first."""
        return self.scan.seconds > SHORT_UPLOAD_S


def _merged(parts: Sequence[Part], upload: Upload, options: DecodingOptions) -> Transcription:
    """A chunked upload's transcription, from its chunks', in order."""
    return merge([c for c, _, _ in parts], [t for _, t, _ in parts], upload.scan.seconds, options.language)


class TranscriptionService:
    def __init__(self, settings: Settings, engine: EngineClient, metrics: ServerMetrics, vad: SileroVad) -> None:
        self.settings = settings
        self.engine = engine
        self.jobs = Jobs(engine, settings.request_timeout_s)
        self.metrics = metrics
        self.vad = vad
        self.models = ModelNames(settings)
        self.model_id = self.models.served
        self.rules = RequestRules(settings, self.models)
        self.replies = Replies(metrics)
        self.live = LiveService(settings, self.jobs, metrics, vad, self.rules, self.replies)
        self.speakers = Speakers(self.jobs, vad)
        self.share = FairShare(settings.upload_threads)
        self.budget = AudioBudget(
            settings.max_audio_in_flight_s,
            SHORT_UPLOAD_S,
            self._budget_changed,
            reserve=SHORT_RESERVE_UPLOADS * SHORT_UPLOAD_S,
        )

    def close(self) -> None:
        self.share.close()

    def _budget_changed(self) -> None:
        self.metrics.audio_in_flight.set(self.budget.held)
        self.metrics.budget_waiting.set(self.budget.waiting)

    def chunked_hold_s(self) -> float:
        """What a chunked upload holds at most, in seconds of audio: the chunks being transcribed, a step's block
        and the chunks it may settle, the follower's blocks."""
        return self.settings.max_batch * CHUNK_SECONDS + 3 * STEP_SAMPLES / SAMPLE_RATE

    # -- uploads ---------------------------------------------------------------------------------------
    async def transcribe(self, req: TranscriptionRequest, request_id: str | None = None) -> Reply:
        started = time.perf_counter()
        request_id = request_id or uuid.uuid4().hex
        options, chunking, ask = self.rules.options(req), self.rules.chunking(req), self.rules.speakers(req)
        diarization = None
        async with self._admitted(req, chunking) as upload:
            if chunking is not None:
                diarize = await self._speakers(ask, options, upload)
                scan = self._chunk_scan(upload, chunking, diarized=diarize is not None)
                results = self._chunk_results(request_id, upload, scan, options, prints=diarize is not None)
                async with self._audio_errors(req), aclosing(results) as chunks:
                    parts = [part async for part in chunks]
                queue_ms = parts[0][2] if parts else 0.0
                transcription, diarization = await self._finish(parts, upload, options, diarize, scan)
            else:
                job = Job(request_id, upload.audio, options, samples=upload.scan.samples, background=upload.long)
                transcription, queue_ms = await self.jobs.run(job)
        total_ms = (time.perf_counter() - started) * 1000
        return self.replies.reply(req, transcription, queue_ms, total_ms, diarization)

    async def _speakers(
        self, ask: SpeakerAsk | None, options: DecodingOptions, upload: Upload
    ) -> SpeakerRequest | None:
        """A diarized upload's speaker request, its known speakers' prints taken (on its upload threads' share)."""
        if ask is None:
            return None
        prints = await self.speakers.references(ask, options, functools.partial(self.share.run, upload.account))
        return ask.request(prints)

    async def _finish(
        self,
        parts: Sequence[Part],
        upload: Upload,
        options: DecodingOptions,
        diarize: SpeakerRequest | None,
        scan: ChunkScan,
    ) -> tuple[Transcription, Diarization | None]:
        """A chunked upload's transcription from its chunks', and who said what when it asks."""
        transcription = _merged(parts, upload, options)
        if diarize is None:
            return transcription, None
        return transcription, await self.speakers.label(parts, transcription, diarize, scan.voiced_speech)

    async def transcribe_stream(self, req: TranscriptionRequest, request_id: str | None = None) -> HeldEvents:
        """Validate the request and read its audio now (errors raise here), then return its events, its place in
        the audio budget held until they end or are closed: `transcript.text.delta` per segment as windows (or chunks)
        complete, then `transcript.text.done`."""
        started = time.perf_counter()
        request_id = request_id or uuid.uuid4().hex
        options, chunking, ask = self.rules.options(req), self.rules.chunking(req), self.rules.speakers(req)
        admitted = self._admitted(req, chunking)
        upload = await admitted.__aenter__()
        try:
            if chunking is not None:
                diarize = await self._speakers(ask, options, upload)
                diarized = diarize is not None
                scan = self._chunk_scan(upload, chunking, diarized=diarized)
                events = chunk_events(
                    req,
                    functools.partial(self._chunk_results, request_id, upload, scan, options, prints=diarized),
                    functools.partial(self._audio_errors, req),
                    functools.partial(self._finish, upload=upload, options=options, diarize=diarize, scan=scan),
                    self.replies,
                    started,
                )
                return HeldEvents(events, admitted)
            job = Job(
                request_id, upload.audio, options, stream=True, samples=upload.scan.samples, background=upload.long
            )
            pending = self.jobs.submit(job)
        except BaseException as exc:
            await admitted.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return HeldEvents(job_events(req, pending, self.jobs, self.replies, started), admitted, pending)

    @asynccontextmanager
    async def _admitted(self, req: TranscriptionRequest, chunking: Chunking | None) -> AsyncIterator[Upload]:
        """The upload's audio, checked whole (`AudioScan`, on the upload threads), while it holds its place in
        the audio budget: ApiError 400/413/415 for bad audio, 429 when the budget's line is full."""
        if len(req.data) > self.settings.max_upload_bytes:
            raise errors.too_large(self.settings.max_upload_bytes)
        if not req.data:
            raise errors.bad_request("The audio file is empty.", param="file", code="empty_file")
        audio = EncodedAudio(req.data, self.settings.max_audio_seconds)
        scan = AudioScan(audio)
        account = self.share.account()
        async with self._audio_errors(req):
            try:
                while not scan.done:
                    await self.share.run(account, scan.step)
            finally:
                self.share.leave(account)  # not while it waits for the budget: the budget's holders need it
        hold = scan.seconds if chunking is None else min(scan.seconds, self.chunked_hold_s())
        try:
            async with self.budget.hold(hold, self.engine.retry_after):
                try:
                    yield Upload(audio, scan, account)
                finally:
                    self.share.leave(account)
        except OverBudget as exc:
            self.metrics.budget_refused.inc()
            raise errors.queue_full(exc.retry_after) from exc

    @asynccontextmanager
    async def _audio_errors(self, req: TranscriptionRequest) -> AsyncIterator[None]:
        """AudioError as the ApiError the client gets: 400 (415 where the upload says it is not audio)."""
        try:
            yield
        except AudioTooLongError as exc:
            raise errors.bad_request(str(exc), param="file", code="audio_too_long") from exc
        except AudioError as exc:
            if req.content_type and req.content_type.startswith(NON_AUDIO_TYPES):
                raise errors.unsupported_media(f"Unsupported media type {req.content_type}: {exc}") from exc
            raise errors.bad_request(
                f"Could not decode the audio file: {exc}", param="file", code="invalid_audio"
            ) from exc

    def _chunk_scan(self, upload: Upload, chunking: Chunking, *, diarized: bool) -> ChunkScan:
        """The VAD's pass over an upload. It also finds the finer speech regions that a diarized upload's pieces
        keep to and that "auto" levels each chunk by (the same regions either way: diarization changes no word)."""
        speech = SPEECH_VAD if diarized or chunking.normalize else None
        finder = functools.partial(self.vad.finder, chunking.params, CHUNK_SECONDS, speech)
        return ChunkScan(upload.audio, finder, level=chunking.normalize, voiced=diarized)

    def _decoded_again(self, kept: bool) -> None:
        self.metrics.chunks_decoded_again.labels(kept="true" if kept else "false").inc()

    def _chunk_results(
        self,
        request_id: str,
        upload: Upload,
        chunks: ChunkScan,
        options: DecodingOptions,
        *,
        prints: bool = False,
    ) -> AsyncGenerator[Part, None]:
        """The upload's chunks with their transcriptions and queue times, in order (`uploads.chunk_results`)."""

        def run(step: Callable[[], T]) -> Any:
            return self.share.run(upload.account, step)

        def transcribe(k: int, chunk: Chunk, samples: np.ndarray) -> Any:
            names = (f"{request_id}-{k}" + (f".{n}" if n else "") for n in itertools.count())  # the chunk, its halves

            def run_job(piece: Chunk, audio: np.ndarray) -> Any:
                voices = prints_of(piece) if prints else None
                job = Job(next(names), audio, options, turn=k, background=upload.long, prints=voices)
                return self.jobs.run(job)

            regions = regions_in(chunk, chunks.speech or chunk.pieces)
            return written_in_full(chunk, samples, regions, run_job, self._decoded_again)

        idle = functools.partial(self.share.leave, upload.account)  # its long place, while it waits for the worker
        return chunk_results(chunks, run, transcribe, self.settings.max_batch, idle)
