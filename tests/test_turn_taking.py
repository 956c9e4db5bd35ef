"""Turns ended by the server, on real speech through the real server: no word lost at a turn's end (server
VAD), and semantic VAD waiting through mid-sentence pauses that server VAD cuts at."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import OpenAI

from app.api.audio import decode_audio
from tests.server import ServerProcess, openai_client
from tests.test_streaming import OPEN, Live, live, wav, words

RATE = 16000
QUIET_CLIPS = ("LJ001-0002", "LJ001-0008", "LJ001-0013")  # short sentences without a pause inside
SENTENCE = ("LJ001-0006", "LJ001-0007", "LJ001-0008")  # one sentence, read as three clips
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(scope="module")
def server(live_server: ServerProcess) -> ServerProcess:
    return live_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return openai_client(server)


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().ws.close()


def pcm(benchdata: Path, clip: str) -> np.ndarray:
    audio = decode_audio((benchdata / "audio" / "ljspeech" / f"{clip}.wav").read_bytes(), 600)
    return (np.clip(audio, -1, 32767 / 32768) * 32768).astype(np.int16)


def fade_out(speech: np.ndarray, seconds: float = 0.3, to: float = 0.05) -> np.ndarray:
    """The clip with its last word's end made quiet (a falling voice), below the VAD's speech threshold."""
    n = int(seconds * RATE)
    gain = np.ones(speech.size, np.float32)
    gain[-n:] = np.geomspace(1.0, to, n)
    return (speech * gain).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.int16)


def session(server: ServerProcess, turn_detection: dict[str, Any]) -> Live:
    s = live(server)
    s.wait_for("session.created")
    s.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": turn_detection,
        "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"}}}}})  # fmt: skip
    s.wait_for("session.updated")
    return s


@pytest.mark.parametrize("vad", [{"type": "server_vad"}, {"type": "server_vad", "prefix_padding_ms": 600,
                                                          "silence_duration_ms": 350}])  # fmt: skip  # LiveKit's
def test_a_quiet_last_word_is_kept(server: ServerProcess, client: OpenAI, benchdata: Path, vad: dict[str, Any]) -> None:
    """Each turn ends `silence_duration_ms` after its speech (`audio_end_ms` says so) and its final has the words
    an upload of the turn's clip has, the quiet last one included."""
    clips = [fade_out(pcm(benchdata, c)) for c in QUIET_CLIPS]
    s = session(server, vad)
    ends, at = [], 1.0
    s.stream(silence(1.0), RATE)
    for clip in clips:
        s.stream(np.concatenate([clip, silence(1.5)]), RATE)
        ends.append(at + clip.size / RATE)
        at += clip.size / RATE + 1.5
    finals = s.wait_for(COMPLETED, count=len(clips))
    stopped = s.of_type("input_audio_buffer.speech_stopped")
    silence_ms = vad.get("silence_duration_ms", 500)
    for clip, final, stop, end in zip(clips, finals, stopped, ends, strict=True):
        upload = client.audio.transcriptions.create(model="whisper-1", file=("t.wav", wav(clip)), language="en")
        assert words(final["transcript"]) == words(upload.text), (final["transcript"], upload.text)
        # The turn's audio runs on past the speech by the silence that ended it (the VAD hears the quiet end as
        # silence: up to 0.3 s of it).
        assert end * 1000 - 300 + silence_ms <= stop["audio_end_ms"] <= end * 1000 + silence_ms + 100, (stop, end)
        assert final["usage"]["seconds"] >= silence_ms / 1000


def test_semantic_vad_waits_through_a_mid_sentence_pause(
    server: ServerProcess, client: OpenAI, benchdata: Path
) -> None:
    """One sentence read with two 1.2-s pauses inside (after "typography," and "1455,"): server VAD at its 500 ms
    cuts it there; semantic VAD (eagerness low: up to 8 s) keeps it one turn, and ends it well before its bound
    once the words read finished. Both give every word. Two sessions at once, in real time."""
    parts = [pcm(benchdata, c) for c in SENTENCE]
    audio = np.concatenate([parts[0], silence(1.2), parts[1], silence(1.2), parts[2]])
    speech_end_ms = (1.0 + audio.size / RATE) * 1000
    sessions = {
        "server": session(server, {"type": "server_vad"}),
        "semantic": session(server, {"type": "semantic_vad", "eagerness": "low"}),
    }
    streams = [
        threading.Thread(target=s.stream, args=(np.concatenate([silence(1.0), audio, silence(9.0)]), RATE, 1.0))
        for s in sessions.values()
    ]
    for thread in streams:
        thread.start()
    for thread in streams:
        thread.join()
    upload = words(
        client.audio.transcriptions.create(model="whisper-1", file=("s.wav", wav(audio)), language="en").text
    )
    semantic = sessions["semantic"].wait_for(COMPLETED)
    assert len(semantic) == 1, [f["transcript"] for f in semantic]
    assert words(semantic[0]["transcript"]) == upload
    stop = sessions["semantic"].of_type("input_audio_buffer.speech_stopped")[0]
    assert stop["audio_end_ms"] < speech_end_ms + 8000 - 4000, stop  # the words ended it, not the 8-s bound
    server_vad = sessions["server"].wait_for(COMPLETED, count=2)
    heard = [w for f in server_vad for w in words(f["transcript"])]
    assert len(server_vad) >= 2 and len(set(heard) & set(upload)) >= 0.9 * len(set(upload))
