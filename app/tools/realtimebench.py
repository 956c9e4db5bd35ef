"""Live latency, measured: clips streamed in real time over N concurrent Realtime sessions.

`python -m app realtimebench` starts a server (or uses `--url`) and, for each session count (1, 4, 8) and
input format (pcm16 at 24 kHz, G.711 mu-law at 8 kHz), opens that many transcription sessions with server VAD
(`silence_duration_ms` 500 by default). Each session streams the same English clips in turn, in 20-ms appends
paced at real time, each clip between 1 s of silence before and 1.5 s after; the sessions start spread over
one clip's period (as independent callers would; started together, every utterance would end at the same
moment and the finals would come as one burst). Per clip it records, against the
moment the clip's last sample was sent (the end of speech as the speaker sees it): when `speech_stopped`
arrived, when the last `...transcription.completed` of the clip's speech arrived; and, from its first sample,
when its first text arrived (a `...transcription.partial`, which the sessions ask for, or a delta). It
reports p50/p95 of each (and of `completed` on clips whose reference ends a sentence), the WER of the finals,
how often a clip's speech was cut into more than one turn, and how many clips' finals lost the last word an
upload of the same audio has.

`--turn-detection server_vad,semantic_vad` runs each level with both, in turn; `--pause-ms 800` puts that much
silence inside a sentence of every clip (between the two words nearest its middle that no punctuation separates,
found from an upload's word timestamps): what a speaker who stops to think does, and what semantic VAD should
wait through.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import soxr

from app.api.audio import SAMPLE_RATE, load_audio
from app.tools.bench import error_rate, normalize
from app.tools.manifest import ManifestClip, read_manifest
from app.tools.process import ServerProcess

STEP_S = 0.02
LEAD_S, TAIL_S = 1.0, 1.5
FORMATS = ("pcm16", "g711_ulaw")


def encode(audio: np.ndarray, audio_format: str) -> tuple[bytes, int]:
    """16-kHz samples as a client sends them: (bytes, bytes per second)."""
    if audio_format == "pcm16":
        up = soxr.resample(audio, SAMPLE_RATE, 24000)
        return (np.clip(up, -1, 32767 / 32768) * 32768).round().astype("<i2").tobytes(), 48000
    out = io.BytesIO()
    subtype = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}[audio_format]
    sf.write(out, soxr.resample(audio, SAMPLE_RATE, 8000), 8000, format="RAW", subtype=subtype)
    return out.getvalue(), 8000


@dataclass
class ClipRun:
    reference: str
    start_ms: float  # the clip's speech in the session's audio (ms)
    end_ms: float
    speech_start: float = 0.0  # perf_counter when its first / last sample was sent
    speech_end: float = 0.0
    stopped: float | None = None
    completed: float | None = None
    first_delta: float | None = None
    texts: list[str] = field(default_factory=list)


async def realtime_session(
    url: str,
    clips: list[tuple[np.ndarray, str]],
    audio_format: str,
    turn_detection: dict[str, Any],
    delay: float = 0.0,
    step_s: float = STEP_S,
) -> list[ClipRun]:
    """One Realtime transcription session streaming `clips` in turn (each between LEAD_S and TAIL_S of
    silence), in appends of `step_s` sent as each one's audio has been captured (real time)."""
    import websockets

    await asyncio.sleep(delay)
    runs: list[ClipRun] = []
    position_ms = 0.0
    items: dict[str, ClipRun] = {}  # item id -> the clip its speech started in
    async with websockets.connect(
        url.replace("http://", "ws://") + "/v1/realtime?intent=transcription", max_size=None
    ) as ws:
        await ws.recv()
        update = {"input_audio_format": audio_format, "turn_detection": turn_detection,
                  "include": ["item.input_audio_transcription.partials"],
                  "input_audio_transcription": {"model": "whisper-1", "language": "en"}}  # fmt: skip
        await ws.send(json.dumps({"type": "transcription_session.update", "session": update}))
        while json.loads(await ws.recv())["type"] != "transcription_session.updated":
            pass
        finished = asyncio.Event()
        expected = len(clips)

        async def read() -> None:
            async for message in ws:
                now = time.perf_counter()
                event = json.loads(message)
                kind = event["type"]
                if kind == "error":
                    raise RuntimeError(event["error"])
                if kind == "input_audio_buffer.speech_started":
                    at = event["audio_start_ms"]
                    items[event["item_id"]] = next((r for r in runs if r.start_ms - 500 <= at < r.end_ms), runs[-1])
                run = items.get(event.get("item_id", ""))
                if run is None:
                    continue
                if kind == "input_audio_buffer.speech_stopped":
                    run.stopped = now
                elif kind.endswith(("transcription.partial", "transcription.delta")) and run.first_delta is None:
                    run.first_delta = now
                elif kind.endswith("transcription.completed"):
                    run.completed = now
                    run.texts.append(event["transcript"])
                    if run is runs[-1] and len(runs) == expected and run.stopped is not None:
                        finished.set()

        reader = asyncio.create_task(read())
        for audio, reference in clips:
            lead, tail = (np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (LEAD_S, TAIL_S))
            data, rate = encode(np.concatenate([lead, audio, tail]), audio_format)
            speech_s = audio.size / SAMPLE_RATE
            run = ClipRun(reference, position_ms + LEAD_S * 1000, position_ms + (LEAD_S + speech_s) * 1000)
            runs.append(run)
            width = 2 if audio_format == "pcm16" else 1  # bytes a sample

            async def append(chunk: bytes) -> None:
                event = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
                await ws.send(json.dumps(event))

            await send_paced(append, data, int(rate * step_s) // width * width, rate, step_s, run, speech_s)
            position_ms += len(data) / rate * 1000
        try:
            await asyncio.wait_for(finished.wait(), timeout=60)
        finally:
            reader.cancel()
    return runs


async def send_paced(
    send: Callable[[bytes], Awaitable[None]],
    data: bytes,
    step: int,
    per_second: int,
    step_s: float,
    run: ClipRun,
    speech_s: float,
) -> None:
    """`data` (a clip between LEAD_S and TAIL_S of silence, `per_second` bytes a second of audio) in chunks of
    `step` bytes, each sent once its audio has been captured (every `step_s`, in real time); marks when the
    chunks holding the clip's first and last speech went out (`run.speech_start`, `run.speech_end`)."""
    began = time.perf_counter()
    for k, offset in enumerate(range(0, len(data), step)):
        await asyncio.sleep(max(0.0, began + (k + 1) * step_s - time.perf_counter()))
        await send(data[offset : offset + step])
        sent_s = (offset + step) / per_second
        if run.speech_start == 0.0 and sent_s >= LEAD_S:
            run.speech_start = time.perf_counter()
        if run.speech_end == 0.0 and sent_s >= LEAD_S + speech_s:
            run.speech_end = time.perf_counter()


def nearest_rank(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` by nearest rank (None when there are none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def english_clips(manifest: Path, count: int) -> list[ManifestClip]:
    """The first `count` English clips of 3..15 s in the manifest's short subset: what live sessions stream."""
    entries = read_manifest(manifest)
    return [c for c in entries if c.language == "en" and c.subset == "short" and 3 <= c.duration_s <= 15][:count]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    p95 = nearest_rank(values, 0.95)
    assert p95 is not None
    return {"p50": round(statistics.median(values), 3), "p95": round(p95, 3), "n": len(values)}


def turn_detection(kind: str, silence_ms: int) -> dict[str, Any]:
    """A session's `turn_detection`: `server_vad` at `silence_ms`, or `semantic_vad` (eagerness auto)."""
    return {"type": "server_vad", "silence_duration_ms": silence_ms} if kind == "server_vad" else {"type": kind}


@dataclass(frozen=True)
class LiveClip:
    """A clip as sessions stream it (a pause may have been put inside one of its sentences), with what an upload
    of that audio gives (the words each turn's finals should have, the last one included)."""

    audio: np.ndarray
    reference: str
    uploaded: str

    @property
    def sentence_final(self) -> bool:
        return self.reference.rstrip().endswith((".", "!", "?"))


def _words(text: str) -> list[str]:
    return normalize(text).split()


def with_pause(url: str, audio: np.ndarray, pause_ms: int) -> np.ndarray:
    """`audio` with `pause_ms` of silence between the two words nearest its middle that no punctuation separates
    (a speaker who stops mid-sentence), found from an upload's word timestamps; unchanged if none."""
    if pause_ms <= 0:
        return audio
    answer = _upload(url, audio, {"response_format": "verbose_json", "timestamp_granularities[]": "word"})
    words, spelled = answer.get("words") or [], answer["text"].split()
    if len(words) < 4 or len(words) != len(spelled):
        return audio
    middle = sorted(range(1, len(words) - 2), key=lambda k: abs(k - len(words) / 2))
    k = next((k for k in middle if not spelled[k].endswith((",", ".", ";", ":", "!", "?"))), None)
    if k is None:
        return audio
    cut = int((words[k]["end"] + words[k + 1]["start"]) / 2 * SAMPLE_RATE)
    return np.concatenate([audio[:cut], np.zeros(pause_ms * SAMPLE_RATE // 1000, np.float32), audio[cut:]])


def _upload(url: str, audio: np.ndarray, fields: dict[str, str] | None = None) -> dict[str, Any]:
    out = io.BytesIO()
    sf.write(out, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    response = httpx.post(
        f"{url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "language": "en", **(fields or {})},
        files={"file": ("clip.wav", out.getvalue())},
        timeout=300,
    )
    response.raise_for_status()
    return dict(response.json())


def prepare(url: str, clips: list[tuple[np.ndarray, str]], pause_ms: int) -> list[LiveClip]:
    prepared = []
    for audio, reference in clips:
        audio = with_pause(url, audio, pause_ms)
        prepared.append(LiveClip(audio, reference, _upload(url, audio)["text"]))
    return prepared


def lost_last_word(clip: LiveClip, run: ClipRun) -> bool:
    """Whether the finals of the clip's turns end before the words an upload of the same audio ends with."""
    heard, uploaded = _words(" ".join(run.texts)), _words(clip.uploaded)
    return bool(uploaded) and heard[-1:] != uploaded[-1:]


async def _level(url: str, clips: list[LiveClip], sessions: int, fmt: str, detection: dict[str, Any]) -> dict[str, Any]:
    period = LEAD_S + TAIL_S + statistics.mean(c.audio.size for c in clips) / SAMPLE_RATE
    streamed = [(c.audio, c.reference) for c in clips]
    results = await asyncio.gather(
        *(realtime_session(url, streamed, fmt, detection, delay=i * period / sessions) for i in range(sessions))
    )
    runs = [r for session in results for r in session]
    pairs = [(c, r) for session in results for c, r in zip(clips, session, strict=True)]
    final_turns = [r for c, r in pairs if c.sentence_final]
    return {
        "sessions": sessions,
        "format": fmt,
        "turn_detection": detection["type"],
        "speech_end_to_speech_stopped_s": percentiles([r.stopped - r.speech_end for r in runs if r.stopped]),
        "speech_end_to_completed_s": percentiles([r.completed - r.speech_end for r in runs if r.completed]),
        "sentence_final_speech_end_to_completed_s": percentiles(
            [r.completed - r.speech_end for r in final_turns if r.completed]
        ),
        "speech_start_to_first_delta_s": percentiles([r.first_delta - r.speech_start for r in runs if r.first_delta]),
        "missing_finals": sum(r.completed is None for r in runs),
        "turns_cut_within_clips": sum(max(0, len(r.texts) - 1) for r in runs),
        "clips_losing_last_word": sum(lost_last_word(c, r) for c, r in pairs),
        "wer": round(error_rate([(r.reference, " ".join(r.texts), "en") for r in runs]), 4),
    }


def run_realtime_bench(
    manifest: Path,
    sessions: list[int],
    formats: list[str],
    n_clips: int,
    silence_ms: int,
    url: str | None,
    turn_detections: tuple[str, ...] = ("server_vad",),
    pause_ms: int = 0,
) -> dict[str, Any]:
    """Each session count, format and turn detection in turn (`semantic_vad` at eagerness auto), over the clips,
    each with a `pause_ms` silence put inside one of its sentences (0: none)."""
    raw = [(load_audio(c.audio), c.text) for c in english_clips(manifest, n_clips)]
    server = None if url else ServerProcess().start()
    base = url or (server.url if server else "")
    try:
        clips = prepare(base, raw, pause_ms)
        warm = turn_detection("server_vad", silence_ms)
        asyncio.run(_level(base, clips[:1], 1, formats[0], warm))  # warm-up: first calls pay one-off costs
        levels = [
            asyncio.run(_level(base, clips, n, fmt, turn_detection(kind, silence_ms)))
            for n in sessions
            for fmt in formats
            for kind in turn_detections
        ]
        return {"silence_duration_ms": silence_ms, "pause_ms": pause_ms, "clips": len(clips), "levels": levels}
    finally:
        if server is not None:
            server.stop()
