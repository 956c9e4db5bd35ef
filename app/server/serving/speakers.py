"""Diarization's side of the serving layer: a request's speaker fields, its known speakers' prints, and who said what.

A diarized upload (`response_format=diarized_json`, or verbose_json with `diarize=true`) is always chunked: each
chunk's job also takes voice prints over its speech pieces (`prints_of`). Known speakers' references are read
and checked up front (`SpeakerAsk`: at most 4, each a data URL of 1.2-10 s of audio), and their prints taken by
the worker (`Speakers.references`) before the upload is queued. Once every chunk is done, `Speakers.label`
clusters all prints on the upload's timeline and gives the merged transcript's words their speakers, off the
event loop (`app.speakers.diarization.label_speakers`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app.api import errors
from app.api.audio import SAMPLE_RATE, AudioError, AudioTooLongError, decode_audio
from app.api.types import DecodingOptions, Transcription, Voice
from app.server.serving.chunking import Chunk
from app.server.serving.jobs import Jobs
from app.server.vad import SileroVad, VadParams
from app.server.worker.protocol import Job, PrintRequest
from app.speakers.clustering import unit_mean
from app.speakers.diarization import Diarization, SpeakerRequest, label_speakers

MAX_KNOWN = 4
REFERENCE_S = (1.2, 10.0)  # a reference's length, as OpenAI bounds it
MAX_SPEAKERS = 32
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[^;,]*)*;base64,(?P<data>.*)", re.S)
REFERENCE_VAD = VadParams(threshold=0.5, prefix_padding_ms=100, silence_duration_ms=300)
# Where a diarized transcript's pieces are cut and kept to: pauses of 300 ms, 30 ms kept around speech (Silero's
# own padding). Whisper's word times stretch over pauses; kept to these regions, the 2-voice conversation's DER
# fell from 13% to 8% (`bench-audio --part diarization`; 100 ms of padding gave 9%, 200-ms pauses 9%).
SPEECH_VAD = VadParams(threshold=0.5, prefix_padding_ms=30, silence_duration_ms=300)


@dataclass(frozen=True)
class SpeakerAsk:
    """A request's speaker fields, checked: known speakers' names and reference audio (bytes), bounds."""

    names: tuple[str, ...] = ()
    references: tuple[bytes, ...] = ()
    min_speakers: int | None = None
    max_speakers: int | None = None

    @classmethod
    def parse(cls, names: Sequence[str], references: Sequence[str], bounds: dict[str, str]) -> SpeakerAsk:
        """ApiError 400 naming the field that is wrong."""
        names = tuple(n.strip() for n in names)
        if len(names) > MAX_KNOWN:
            raise errors.bad_request(
                f"known_speaker_names may hold at most {MAX_KNOWN} names", param="known_speaker_names[]"
            )
        if len(references) != len(names):
            raise errors.bad_request(
                "known_speaker_names and known_speaker_references must have the same number of entries",
                param="known_speaker_references[]",
            )
        if any(not n for n in names) or len(set(names)) != len(names):
            raise errors.bad_request(
                "known speaker names must be distinct and not empty", param="known_speaker_names[]"
            )
        found = {name: _count(name, value) for name, value in bounds.items()}
        low, high = found.get("min_speakers"), found.get("max_speakers")
        if low is not None and high is not None and low > high:
            raise errors.bad_request("min_speakers is more than max_speakers", param="min_speakers")
        return cls(names, tuple(_data_url(r) for r in references), low, high)

    def request(self, prints: Sequence[np.ndarray]) -> SpeakerRequest:
        return SpeakerRequest(self.names, tuple(prints), self.min_speakers, self.max_speakers)


def _count(name: str, value: str) -> int:
    try:
        count = int(value.strip())
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SPEAKERS:
        raise errors.bad_request(f"{name} must be a whole number within 1..{MAX_SPEAKERS}", param=name)
    return count


def _data_url(value: str) -> bytes:
    """A reference's audio bytes, from `data:audio/...;base64,...`."""
    match = _DATA_URL.fullmatch(value.strip())
    if match is None:
        raise errors.bad_request(
            "each known speaker reference must be a data URL (data:audio/...;base64,...)",
            param="known_speaker_references[]",
        )
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise errors.bad_request(
            "a known speaker reference's base64 does not decode", param="known_speaker_references[]"
        ) from None
    if not data:
        raise errors.bad_request("a known speaker reference is empty", param="known_speaker_references[]")
    return data


def prints_of(chunk: Chunk) -> PrintRequest:
    """A chunk's speech pieces, as samples of its own audio (the pieces laid end to end)."""
    pieces, at = [], 0
    for start, end in chunk.pieces:
        pieces.append((at, at + end - start))
        at += end - start
    return PrintRequest(tuple(pieces))


def on_upload_timeline(chunk: Chunk, voices: Sequence[Voice]) -> list[Voice]:
    """A chunk's prints, their times moved from the chunk's audio onto the upload's."""
    return [replace(v, start=chunk.to_original(v.start), end=chunk.to_original(v.end, is_end=True)) for v in voices]


class Speakers:
    def __init__(self, jobs: Jobs, vad: SileroVad) -> None:
        self.jobs = jobs
        self.vad = vad

    async def references(
        self, ask: SpeakerAsk, options: DecodingOptions, run: Callable[[Callable[[], Any]], Awaitable[Any]]
    ) -> list[np.ndarray]:
        """Each known speaker's print (ApiError 400 for a reference that does not decode or is too short or long):
        its speech found by the VAD, printed by the worker, the prints' mean."""
        prints = []
        for data in ask.references:
            samples: np.ndarray = await run(functools.partial(_reference_audio, data))
            pieces: list[tuple[int, int]] = await run(functools.partial(self.vad.regions, samples, REFERENCE_VAD))
            job = Job(
                f"ref_{uuid.uuid4().hex}",
                samples,
                options,
                prints=PrintRequest(tuple(pieces) or ((0, samples.size),), only=True),
            )
            transcription, _ = await self.jobs.run(job)
            prints.append(unit_mean(np.stack([v.vector for v in transcription.voices])))
        return prints

    async def label(
        self,
        parts: Sequence[tuple[Chunk, Transcription, float]],
        merged: Transcription,
        request: SpeakerRequest,
        speech: Sequence[tuple[int, int]] = (),
    ) -> Diarization:
        """Who said each piece of the merged transcript, from every chunk's prints (clustered off the loop);
        `speech`: the upload's speech regions (samples: `SPEECH_VAD`'s less their quiet ends,
        `ChunkScan.voiced_speech`), which the pieces keep to."""
        voices = [v for chunk, t, _ in parts for v in on_upload_timeline(chunk, t.voices)]
        spans = [(start / SAMPLE_RATE, end / SAMPLE_RATE) for start, end in speech]
        return await asyncio.to_thread(label_speakers, voices, merged.segments, request, spans)


def _reference_audio(data: bytes) -> np.ndarray:
    low, high = REFERENCE_S
    try:
        samples = decode_audio(data, max_seconds=high + 1)
    except AudioTooLongError:
        raise errors.bad_request(
            f"each known speaker reference must hold {low}-{high} s of audio", param="known_speaker_references[]"
        ) from None
    except AudioError as exc:
        raise errors.bad_request(
            f"a known speaker reference could not be decoded: {exc}", param="known_speaker_references[]"
        ) from exc
    seconds = samples.size / SAMPLE_RATE
    if not low <= seconds <= high:
        raise errors.bad_request(
            f"each known speaker reference must hold {low}-{high} s of audio, not {seconds:.2f} s",
            param="known_speaker_references[]",
        )
    return samples
