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
    cuts: int = 0  # turns that began inside its speech (a pause cut it there)
    last_text: str | None = None  # the text of the turn that ended with it (None: the turn went on)


@dataclass
class TurnRun:
    """One turn the server detected: its audio (ms since the session began), when its events came."""

    start_ms: float
    end_ms: float | None = None
    stopped: float | None = None
    completed: float | None = None
    text: str = ""


async def realtime_session(
    url: str,
    clips: list[tuple[np.ndarray, str]],
    audio_format: str,
    turn_detection: dict[str, Any],
    delay: float = 0.0,
    step_s: float = STEP_S,
) -> list[ClipRun]:
    """One Realtime transcription session streaming `clips` in turn (each between LEAD_S and TAIL_S of
    silence), in appends of `step_s` sent as each one's audio has been captured (real time), then silence until
    every turn is completed. Turns are matched to clips by where their audio lies, so that a turn may hold
    several clips (semantic VAD joins a sentence read as two) or a clip several turns (a pause cut it)."""
    import websockets

    await asyncio.sleep(delay)
    runs: list[ClipRun] = []
    position_ms = 0.0
    turns: dict[str, TurnRun] = {}
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

        async def read() -> None:
            async for message in ws:
                now = time.perf_counter()
                event = json.loads(message)
                kind = event["type"]
                if kind == "error":
                    raise RuntimeError(event["error"])
                if kind == "input_audio_buffer.speech_started":
                    turns[event["item_id"]] = TurnRun(event["audio_start_ms"])
                turn = turns.get(event.get("item_id", ""))
                if turn is None:
                    continue
                if kind == "input_audio_buffer.speech_stopped":
                    turn.end_ms, turn.stopped = event["audio_end_ms"], now
                elif kind.endswith(("transcription.partial", "transcription.delta")):
                    run = next((r for r in runs if r.start_ms - 500 <= turn.start_ms < r.end_ms), None)
                    if run is not None and run.first_delta is None:
                        run.first_delta = now
                elif kind.endswith("transcription.completed"):
                    turn.completed, turn.text = now, event["transcript"]

        reader = asyncio.create_task(read())
        width = 2 if audio_format == "pcm16" else 1  # bytes a sample

        async def append(chunk: bytes) -> None:
            event = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
            await ws.send(json.dumps(event))

        for audio, reference in clips:
            lead, tail = (np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (LEAD_S, TAIL_S))
            data, rate = encode(np.concatenate([lead, audio, tail]), audio_format)
            speech_s = audio.size / SAMPLE_RATE
            run = ClipRun(reference, position_ms + LEAD_S * 1000, position_ms + (LEAD_S + speech_s) * 1000)
            runs.append(run)
            await send_paced(append, data, int(rate * step_s) // width * width, rate, step_s, run, speech_s)
            position_ms += len(data) / rate * 1000
        # A live caller's microphone goes on: silence until every turn is completed (a turn waits up to 8 s).
        data, rate = encode(np.zeros(SAMPLE_RATE, np.float32), audio_format)
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline and (not turns or any(t.completed is None for t in turns.values())):
            if reader.done():
                reader.result()  # raises what the reader raised
            await send_paced(append, data, int(rate * step_s) // width * width, rate, step_s)
        reader.cancel()
    attribute(runs, sorted(turns.values(), key=lambda t: t.start_ms))
    return runs


def attribute(runs: list[ClipRun], turns: list[TurnRun]) -> None:
    """Each clip's figures from the turns: its `stopped` and `completed` are those of the turn its speech ended in;
    its texts, those of the turns that began in it; `cuts`, how many turns began inside its speech; `last_text`,
    the text of the turn that ended with it (none if the turn went on into the next clip)."""
    for k, run in enumerate(runs):
        ended_in = next((t for t in reversed(turns) if t.start_ms <= run.end_ms), None)
        if ended_in is not None:
            run.stopped, run.completed = ended_in.stopped, ended_in.completed
            following = runs[k + 1].start_ms if k + 1 < len(runs) else float("inf")
            if ended_in.end_ms is not None and ended_in.end_ms < following and ended_in.completed is not None:
                run.last_text = ended_in.text
        run.texts = [t.text for t in turns if run.start_ms - 500 <= t.start_ms < run.end_ms and t.completed]
        run.cuts = sum(run.start_ms + 300 < t.start_ms < run.end_ms for t in turns)


async def send_paced(
    send: Callable[[bytes], Awaitable[None]],
    data: bytes,
    step: int,
    per_second: int,
    step_s: float,
    run: ClipRun | None = None,
    speech_s: float = 0.0,
) -> None:
    """`data` (a clip between LEAD_S and TAIL_S of silence, `per_second` bytes a second of audio) in chunks of
    `step` bytes, each sent once its audio has been captured (every `step_s`, in real time); marks when the
    chunks holding the clip's first and last speech went out (`run.speech_start`, `run.speech_end`)."""
    began = time.perf_counter()
    for k, offset in enumerate(range(0, len(data), step)):
        await asyncio.sleep(max(0.0, began + (k + 1) * step_s - time.perf_counter()))
        await send(data[offset : offset + step])
        if run is None:
            continue
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
    of that audio, in each input format, gives (the words each turn's finals should have, the last one included)."""

    audio: np.ndarray
    reference: str
    uploaded: dict[str, str]  # input format -> text

    @property
    def sentence_final(self) -> bool:
        """Whether the clip ends a sentence: its reference ends with a full stop, or it has no punctuation at all
        (an utterance-level transcript, a whole sentence)."""
        text = self.reference.rstrip()
        return text.endswith((".", "!", "?")) or not any(mark in text for mark in ".,;:!?")


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


def as_wav(audio: np.ndarray, audio_format: str) -> bytes:
    """16-kHz samples as a WAV file of what a session in `audio_format` hears: pcm16 at 24 kHz, or G.711 at 8 kHz."""
    out = io.BytesIO()
    if audio_format == "pcm16":
        sf.write(out, soxr.resample(audio, SAMPLE_RATE, 24000), 24000, format="WAV", subtype="PCM_16")
    else:
        subtype = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}[audio_format]
        sf.write(out, soxr.resample(audio, SAMPLE_RATE, 8000), 8000, format="WAV", subtype=subtype)
    return out.getvalue()


def _upload(url: str, audio: np.ndarray, fields: dict[str, str] | None = None, audio_format: str = "pcm16") -> Any:
    response = httpx.post(
        f"{url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "language": "en", **(fields or {})},
        files={"file": ("clip.wav", as_wav(audio, audio_format))},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()


def prepare(url: str, clips: list[tuple[np.ndarray, str]], pause_ms: int, formats: list[str]) -> list[LiveClip]:
    prepared = []
    for audio, reference in clips:
        audio = with_pause(url, audio, pause_ms)
        uploaded = {fmt: _upload(url, audio, audio_format=fmt)["text"] for fmt in formats}
        prepared.append(LiveClip(audio, reference, uploaded))
    return prepared


def lost_last_word(clip: LiveClip, run: ClipRun, audio_format: str) -> bool:
    """Whether the turn that ended with the clip ends before the word an upload of the clip's audio ends with."""
    if run.last_text is None:  # the turn went on into the next clip: its end is another clip's
        return False
    heard, uploaded = _words(run.last_text), _words(clip.uploaded[audio_format])
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
        "turns_cut_within_clips": sum(r.cuts for r in runs),
        "clips_joined_to_the_next": sum(r.last_text is None for r in runs[:-1]),
        "clips_losing_last_word": sum(lost_last_word(c, r, fmt) for c, r in pairs),
        # over each session's whole text: a turn may hold several clips, or a clip several turns
        "wer": round(error_rate([_session_text(session) for session in results]), 4),
    }


def _session_text(runs: list[ClipRun]) -> tuple[str, str, str]:
    return " ".join(r.reference for r in runs), " ".join(t for r in runs for t in r.texts), "en"


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
        clips = prepare(base, raw, pause_ms, formats)
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
