"""Clients of a running SpecWhisper deployment (containers behind a load balancer, a Ray cluster): uploads in
the formats devices produce, an SSE stream, a Realtime session, and texts checked against the references."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import soundfile as sf
import soxr

from app.tools.bench import error_rate
from app.tools.manifest import ManifestClip

TRANSCRIPTIONS = "/v1/audio/transcriptions"


def encode(pcm: np.ndarray, kind: str) -> tuple[str, bytes]:
    """A file in one of the formats phones, browsers and recorders produce: (name, bytes)."""
    out = io.BytesIO()
    if kind == "ulaw":  # a telephone line: 8 kHz, G.711 mu-law in WAV
        sf.write(out, soxr.resample(pcm, 16000, 8000), 8000, format="WAV", subtype="ULAW")
        return "call.wav", out.getvalue()
    subtype = {"wav": "PCM_16", "flac": "PCM_16", "ogg": "VORBIS"}[kind]
    sf.write(out, pcm, 16000, format=kind.upper(), subtype=subtype)
    return f"clip.{kind}", out.getvalue()


def check_text(manifest: dict[str, ManifestClip], clip: str, text: str) -> None:
    wer = error_rate([(manifest[clip].text, text, "en")])
    assert wer <= 0.25, f"{clip}: {text!r} against {manifest[clip].text!r} (WER {wer:.2f})"


def transcribe(url: str, name: str, data: bytes, timeout: float = 180) -> httpx.Response:
    return httpx.post(
        f"{url}{TRANSCRIPTIONS}",
        data={"model": "whisper-1", "language": "en"},
        files={"file": (name, data)},
        timeout=timeout,
    )


def realtime_text(url: str, pcm: np.ndarray) -> str:
    """One Realtime API transcription session: 24-kHz pcm16 appended, committed."""
    from websockets.sync.client import connect

    pcm24 = (soxr.resample(pcm, 16000, 24000) * 32767).round().clip(-32768, 32767).astype("<i2").tobytes()
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    beta = {"OpenAI-Beta": "realtime=v1"}  # a beta client says so, and is answered in the beta shapes
    with connect(ws_url, open_timeout=30, max_size=None, additional_headers=beta) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "transcription_session.created"
        update = {"turn_detection": None, "input_audio_transcription": {"model": "whisper-1", "language": "en"}}
        ws.send(json.dumps({"type": "transcription_session.update", "session": update}))
        for start in range(0, len(pcm24), 9600):
            chunk = base64.b64encode(pcm24[start : start + 9600]).decode()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            event = json.loads(ws.recv(timeout=120))
            assert event["type"] != "error", event
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                return str(event["transcript"])
    raise AssertionError("no completed transcription from the realtime session")


def sse_text(url: str, name: str, data: bytes) -> str:
    """A streamed transcription (SSE): the done event's text, deltas checked."""
    deltas, done = [], None
    with httpx.stream(
        "POST",
        f"{url}{TRANSCRIPTIONS}",
        data={"model": "whisper-1", "language": "en", "stream": "true"},
        files={"file": (name, data)},
        timeout=180,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["type"] == "transcript.text.delta":
                    deltas.append(event["delta"])
                elif event["type"] == "transcript.text.done":
                    done = event["text"]
    assert done is not None and "".join(deltas).strip() == done.strip()
    return str(done)
