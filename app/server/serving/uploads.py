"""An upload's audio, read as a stream in bounded steps: never decoded whole in the web process.

An upload is kept as it came (`EncodedAudio`: an hour of FLAC is a few hundred kB, of float32 ~230 MB) and
decoded again for each pass over it, one step of about a minute of audio at a time:

1. `AudioScan` checks that all of it decodes, within the length limit, and counts its samples. Nothing is queued
   before this pass has heard the whole upload, so a bad file is refused whole.
2. A single-block upload then goes to the worker encoded; a chunked one is read by a `ChunkScan`: the VAD
   listens to it block by block, the settled speech regions are packed into chunks, and each chunk's samples
   are cut from a second decoder that follows behind (`SampleReader`), so only a block and the chunks not yet
   decoded are held. Under `chunking_strategy=auto` the VAD hears the audio levelled locally, and each chunk's
   quiet voices are brought up towards its loudest (`leveling`). `chunk_results` queues the chunks as they are
   found, a few at a time.

The samples are those `decode_audio` gives for the same bytes, bit for bit (then levelled under "auto"), whatever
the steps.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from app.api.audio import SAMPLE_RATE, EncodedAudio, SampleReader
from app.server.serving.chunking import CHUNK_SECONDS, Chunk, ChunkPacker, Part
from app.server.serving.leveling import LocalLoudness, leveled, regions_in
from app.server.vad import RegionFinder, VadParams
from app.speakers.voiced import voiced

T = TypeVar("T")

STEP_SAMPLES = 1 << 20  # decoded samples per step (~65 s at 16 kHz: ~0.2 s of VAD on a CPU core)

# A `server_vad` object's defaults: OpenAI's for chunking (a 200-ms pause ends speech).
UPLOAD_VAD = VadParams(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=200)
# "auto": only pauses of 2 s or more are left out, with 400 ms kept on each side (faster-whisper's VAD defaults).
# On `bench-audio`'s 10-minute file it kept WER at the sequential long-form's (0.173 against 0.176, where
# 200/300 gave 0.191), for 1.2x the speed of sequential instead of 1.4x.
AUTO_VAD = VadParams(threshold=0.5, prefix_padding_ms=400, silence_duration_ms=2000)


@dataclass(frozen=True)
class Chunking:
    """How an upload is cut into chunks by the VAD (`normalize`: level its loudness for the VAD first)."""

    params: VadParams
    normalize: bool


def _steps(blocks: Iterator[np.ndarray], size: int = STEP_SAMPLES) -> Iterator[np.ndarray]:
    """The blocks regrouped into steps of at least `size` samples (the last may be shorter): FFmpeg gives a block
    per frame, a few hundred samples."""
    held: list[np.ndarray] = []
    count = 0
    for block in blocks:
        held.append(block)
        count += block.size
        if count >= size:
            yield np.concatenate(held) if len(held) > 1 else held[0]
            held, count = [], 0
    if held:
        yield np.concatenate(held) if len(held) > 1 else held[0]


class AudioScan:
    """The first pass over an upload: decodes it all (AudioError where it cannot) and counts its samples. Call
    `step` until `done`."""

    def __init__(self, audio: EncodedAudio) -> None:
        self._steps = _steps(audio.blocks())
        self.samples = 0
        self.done = False

    def step(self) -> None:
        block = next(self._steps, None)
        if block is None:
            self.done = True
            return
        self.samples += block.size

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE


class ChunkScan:
    """The VAD's pass over an upload: each `step` decodes a block, runs the VAD (a `finder()`) over it, and returns
    the chunks that block settled, each with its samples (cut from a second decoder that follows behind). With
    `level` ("auto"), the VAD hears the audio levelled locally and each chunk's quiet voices are raised towards
    its loudest (`leveling`: the finder must then find the finer speech regions too). With `voiced` (a diarized
    upload), the finer regions are also kept trimmed to their voiced frames (`voiced_speech`)."""

    def __init__(
        self, audio: EncodedAudio, finder: Callable[[], RegionFinder], *, level: bool = False, voiced: bool = False
    ) -> None:
        self._steps = _steps(audio.blocks())
        self._loudness = LocalLoudness() if level else None
        self._reader = SampleReader(audio.blocks())
        self._new_finder = finder  # called in the first step (it may wait for the VAD to load)
        self._finder: RegionFinder | None = None
        self._packer = ChunkPacker(CHUNK_SECONDS)
        self._voiced = voiced
        self.voiced_speech: list[tuple[int, int]] = []  # the finer regions trimmed to their voice (samples)
        self.done = False

    def step(self) -> list[tuple[Chunk, np.ndarray]]:
        if self._finder is None:
            self._finder = self._new_finder()
        block = next(self._steps, None)
        if block is None:
            self.done = True
            regions = self._finder.feed(self._loudness.finish()) if self._loudness is not None else []
            regions += self._finder.finish()
        else:
            regions = self._finder.feed(self._loudness.feed(block) if self._loudness is not None else block)
        chunks = [chunk for region in regions for chunk in self._packer.add(*region)]
        if self.done:
            chunks += self._packer.finish()
        out = [(c, np.concatenate([self._reader.take(start, end) for start, end in c.pieces])) for c in chunks]
        if not (self._voiced or self._loudness is not None):
            return out
        fine = [regions_in(c, self.speech) for c in chunks]  # each chunk's finer regions, as samples of its audio
        if self._voiced:  # trimmed on the samples as read, before any levelling
            for (c, samples), inside in zip(out, fine, strict=True):
                self.voiced_speech += _on_upload(c, voiced(samples, inside, c.seams))
        if self._loudness is not None:
            out = [(c, leveled(samples, inside)) for (c, samples), inside in zip(out, fine, strict=True)]
        return out

    @property
    def speech(self) -> list[tuple[int, int]]:
        """The finer speech regions found so far (samples), when the finder looks for them (`RegionFinder.speech`)."""
        return self._finder.speech if self._finder is not None else []


def _on_upload(chunk: Chunk, regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Regions as samples of a chunk's audio -> as samples of the upload."""
    return [
        (round(chunk.to_original(a / SAMPLE_RATE) * SAMPLE_RATE),
         round(chunk.to_original(b / SAMPLE_RATE, is_end=True) * SAMPLE_RATE))
        for a, b in regions
    ]  # fmt: skip


async def chunk_results(
    scan: ChunkScan,
    run: Callable[[Callable[[], list[tuple[Chunk, np.ndarray]]]], Awaitable[list[tuple[Chunk, np.ndarray]]]],
    transcribe: Callable[[int, Chunk, np.ndarray], Awaitable[list[Part]]],
    ahead: int,
    idle: Callable[[], None] = lambda: None,
) -> AsyncGenerator[Part, None]:
    """Each chunk of `scan` with its transcription and queue time, in order. `run` runs a step of the scan (on an
    upload thread), `transcribe(k, chunk, samples)` transcribes the k-th chunk (as one part or more, in order).
    The scan goes on while at most `ahead` chunks are being transcribed: they fill a batch together, other
    requests' jobs take turns with them, and the VAD listens on while they are decoded. `idle()` is called when
    it waits for transcriptions only."""
    found: deque[tuple[Chunk, np.ndarray]] = deque()
    queued: deque[asyncio.Future[list[Part]]] = deque()
    step: asyncio.Future[list[tuple[Chunk, np.ndarray]]] | None = None
    dispatched = 0
    try:
        while True:
            while found and len(queued) < ahead:
                chunk, samples = found.popleft()
                queued.append(asyncio.ensure_future(transcribe(dispatched, chunk, samples)))
                dispatched += 1
            if step is None and not scan.done and not found and len(queued) < ahead:
                step = asyncio.ensure_future(run(scan.step))
            if step is None and not queued and not found:
                return
            waits: list[asyncio.Future[Any]] = [f for f in ([queued[0]] if queued else []) + [step] if f]
            if step is None:
                idle()
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if step is not None and step.done():
                found.extend(step.result())
                step = None
            if queued and queued[0].done():
                for part in queued.popleft().result():
                    yield part
    finally:  # the client went away, or a chunk failed: drop the rest (a step under way ends by itself)
        for future in [*queued] + ([step] if step is not None else []):
            future.cancel()
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: its error is the one already raised, or moot
