"""Live audio into each server's own protocol, timed alike: SpecWhisper's Realtime API and WhisperLive's.

A session streams clips in turn, each between `LEAD_S` of silence before and `TAIL_S` after, paced in real
time in chunks of the same duration for every protocol, each chunk sent once its audio has been captured.
Per clip (`ClipRun`): when the chunk holding its last speech sample was sent (the end of the utterance), when
its first partial text arrived and when its final text did.

What a "final" is differs by protocol:
- Realtime: the last `...transcription.completed` of the clip's speech (server VAD commits a turn after
  `silence_duration_ms` of silence).
- WhisperLive: each message carries the recent segments, finished ones marked `completed` (a segment is
  finished when Whisper puts another after it, or when the same unfinished text came back
  `same_output_threshold` times). The clip's final is the message that brought its last new completed
  segment (a segment is the clip's when its midpoint lies in the clip's stretch of the session's audio). A
  caller keeps sending audio after speaking, so the session streams silence after its last clip until every
  clip's text is finished (or `FINISH_TIMEOUT_S` passes).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np

from app.api.audio import SAMPLE_RATE
from app.tools.realtimebench import LEAD_S, TAIL_S, ClipRun, realtime_session, send_paced

FINISH_TIMEOUT_S = 30.0
Clips = list[tuple[np.ndarray, str]]


async def openai_realtime(url: str, clips: Clips, delay: float, step_s: float, silence_ms: int) -> list[ClipRun]:
    """SpecWhisper's `/v1/realtime` (the beta transcription session, pcm16 at 24 kHz, server VAD)."""
    vad = {"type": "server_vad", "silence_duration_ms": silence_ms}
    return await realtime_session(url, clips, "pcm16", vad, delay=delay, step_s=step_s)


async def whisperlive(url: str, clips: Clips, delay: float, step_s: float, language: str = "en") -> list[ClipRun]:
    """WhisperLive's WebSocket protocol: a JSON options message, SERVER_READY, then float32 16-kHz audio."""
    import websockets

    await asyncio.sleep(delay)
    runs: list[ClipRun] = []
    spans: list[tuple[float, float]] = []  # each clip's stretch of the session's audio (s)
    seen: set[tuple[str, str, str]] = set()  # completed segments already counted
    unfinished: list[int] = []  # the clips with an unfinished segment in the latest message
    done = asyncio.Event()

    def owner(segment: dict[str, str]) -> int | None:
        middle = (float(segment["start"]) + float(segment["end"])) / 2
        return next((i for i, (a, b) in enumerate(spans) if a <= middle < b), None)

    async with websockets.connect(url, max_size=None) as ws:
        options = {
            "uid": uuid.uuid4().hex,
            "language": language,
            "task": "transcribe",
            "model": "server's",
            "use_vad": True,
            "send_last_n_segments": 10,
            "no_speech_thresh": 0.45,
            "clip_audio": False,
            "same_output_threshold": 10,
        }  # its client's defaults (the server loads its own model path, whatever `model` says)
        await ws.send(json.dumps(options))
        while True:
            message = json.loads(await ws.recv())
            if message.get("message") == "SERVER_READY":
                break
            if message.get("status") in ("WAIT", "ERROR"):
                raise RuntimeError(f"WhisperLive refused the session: {message}")

        async def read() -> None:
            async for raw in ws:
                now = time.perf_counter()
                message = json.loads(raw)
                segments = message.get("segments") or []
                unfinished.clear()
                for segment in segments:
                    index = owner(segment)
                    if index is None or not segment["text"].strip():
                        continue
                    run = runs[index]
                    if run.first_delta is None:
                        run.first_delta = now
                    if not segment["completed"]:
                        unfinished.append(index)
                    elif (key := (segment["start"], segment["end"], segment["text"])) not in seen:
                        seen.add(key)
                        run.texts.append(segment["text"].strip())
                        run.completed = now
                if len(runs) == len(clips) and not unfinished and all(r.completed for r in runs):
                    done.set()

        reader = asyncio.create_task(read())
        position = 0.0
        step = int(SAMPLE_RATE * step_s)
        try:
            for audio, reference in clips:
                lead, tail = (np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (LEAD_S, TAIL_S))
                samples = np.concatenate([lead, audio, tail]).astype(np.float32)
                speech_s = audio.size / SAMPLE_RATE
                length = samples.size / SAMPLE_RATE
                spans.append((position, position + length))
                run = ClipRun(reference, (position + LEAD_S) * 1000, (position + LEAD_S + speech_s) * 1000)
                runs.append(run)
                await send_paced(ws.send, samples.tobytes(), step * 4, SAMPLE_RATE * 4, step_s, run, speech_s)
                position += length
            silence = np.zeros(step, np.float32).tobytes()
            deadline = time.perf_counter() + FINISH_TIMEOUT_S
            while not done.is_set() and time.perf_counter() < deadline and not reader.done():
                await ws.send(silence)
                await asyncio.sleep(step_s)
        finally:
            reader.cancel()
    for run in runs:
        if run.completed is not None and run.completed < run.speech_end:
            run.completed = None  # its text never finished after the utterance ended: no final
    return runs
