"""Streaming against the real server: SSE through the `openai` SDK, live audio over the Realtime WebSocket."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import soxr
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from app.api.audio import decode_audio
from tests.server import ServerProcess, metric, openai_client, server_fixture

CLIP = "audio/ljspeech/LJ001-0001.wav"
LONG_CLIP = "audio/fleurs/fleurs-de-009.wav"  # 43 s: two windows
CHUNK_S = 0.1
SPEEDUP = 3.0  # stream audio three times faster than real time


@pytest.fixture(scope="module")
def server(live_server: ServerProcess) -> ServerProcess:
    return live_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def speech(benchdata: Path) -> np.ndarray:
    """The clip at 16 kHz, quantized to pcm16 exactly as a live client sends it."""
    audio = decode_audio((benchdata / CLIP).read_bytes(), 600)
    return (np.clip(audio, -1, 32767 / 32768) * 32768).astype(np.int16)


def wav(pcm: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    sf.write(out, pcm, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


# -- server-sent events ---------------------------------------------------------------------------------
def test_sse_streams_deltas_then_done_through_the_openai_client(client: OpenAI, benchdata: Path) -> None:
    data = (benchdata / LONG_CLIP).read_bytes()
    plain = client.audio.transcriptions.create(model="whisper-1", file=("de.wav", data), language="de")
    stream = client.audio.transcriptions.create(model="whisper-1", file=("de.wav", data), language="de", stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert len(kinds) >= 3, "a two-window clip streams at least one delta per window"
    deltas = "".join(e.delta for e in events[:-1])  # type: ignore[union-attr]
    done = events[-1]
    assert done.text == plain.text == deltas  # type: ignore[union-attr]
    metrics = done.model_extra["metrics"]  # type: ignore[index]
    assert metrics["tokens"] > 0 and metrics["speculative"] is True


def test_sse_is_incremental_and_errors_before_streaming_are_json(server: ServerProcess, benchdata: Path) -> None:
    data = (benchdata / LONG_CLIP).read_bytes()
    form = {"model": "whisper-1", "stream": "true", "language": "de"}
    arrivals = []
    with httpx.stream("POST", f"{server.url}/v1/audio/transcriptions", data=form, files={"file": ("de.wav", data)},
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter(), json.loads(line[6:])["type"]))
    first_delta = next(t for t, kind in arrivals if kind == "transcript.text.delta")
    assert arrivals[-1][1] == "transcript.text.done"
    assert arrivals[-1][0] - first_delta > 0.2, "the first window's text arrives before the second window is done"
    bad = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={**form, "response_format": "srt"},
        files={"file": ("de.wav", data)},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"
    garbage = httpx.post(
        f"{server.url}/v1/audio/transcriptions", data=form, files={"file": ("x.wav", b"not audio")}, timeout=60
    )
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_audio"


# -- realtime WebSocket ---------------------------------------------------------------------------------
class Live:
    """A scripted Realtime client: sends events, collects every server event on a reader thread."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.closed = threading.Event()
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.ws:
                with self._cv:
                    self.events.append(json.loads(message))
                    self._cv.notify_all()
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()
            with self._cv:
                self._cv.notify_all()

    def send(self, event: dict[str, Any]) -> None:
        self.ws.send(json.dumps(event))

    def stream(self, pcm: np.ndarray, rate: int, speedup: float = SPEEDUP) -> None:
        """Append `pcm` in 100-ms chunks, `speedup` times faster than real time; stops if the server hangs up."""
        step = int(rate * CHUNK_S)
        for i in range(0, pcm.size, step):
            chunk = pcm[i : i + step].astype("<i2").tobytes()
            try:
                self.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            except ConnectionClosed:
                return
            time.sleep(CHUNK_S / speedup)

    def wait_for(self, kind: str, count: int = 1, timeout: float = 120) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(found := [e for e in self.events if e["type"] == kind]) < count:
                remaining = deadline - time.monotonic()
                assert remaining > 0 and not self.closed.is_set(), f"no {count} x {kind}; got {self.kinds()}"
                self._cv.wait(remaining)
        return found

    def kinds(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        with self._cv:
            return [e for e in self.events if e["type"] == kind]


OPEN: list[Live] = []


def live(server: ServerProcess, **kwargs: Any) -> Live:
    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    session = Live(connect(url, max_size=None, **kwargs).__enter__())
    OPEN.append(session)
    return session


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    """A failing test must not leave its sessions open for the next one."""
    yield
    while OPEN:
        OPEN.pop().ws.close()


def test_realtime_commit_matches_upload_deltas_add_up_and_partials_replace(
    server: ServerProcess, client: OpenAI, speech: np.ndarray
) -> None:
    """A beta client that does not send the beta header gets `transcription_session.created` before its first
    `transcription_session.update` is answered; with `include` partials, hypotheses of the open turn come while it
    is spoken; after the commit, the deltas add up to the final transcript exactly, and that is an upload's."""
    session = live(server)
    try:
        assert session.wait_for("session.created")[0]["session"]["type"] == "transcription"
        update = {"input_audio_sample_rate": 16000, "turn_detection": None,
                  "include": ["item.input_audio_transcription.partials"]}  # fmt: skip
        session.send({"type": "transcription_session.update", "session": {**update, "input_audio_transcription": {
            "model": "whisper-1", "language": "en"}}})  # fmt: skip
        updated = session.wait_for("transcription_session.updated")[0]["session"]
        assert session.kinds()[:3] == [
            "session.created",
            "transcription_session.created",
            "transcription_session.updated",
        ]
        assert updated["turn_detection"] is None and updated["input_audio_sample_rate"] == 16000
        session.stream(speech, 16000, speedup=1.0)  # real time: a partial every 0.5 s of new audio
        # Keep the turn open with silence (in real time) until a hypothesis has come; a busy machine is slow.
        sent = [speech]
        silence = np.zeros(1600, dtype=np.int16)
        while not session.of_type("conversation.item.input_audio_transcription.partial"):
            # Stay within one 30-s turn (and one window for the upload it is compared with).
            assert sum(a.size for a in sent) < 16000 * 28, "no partial while the turn was open"
            session.stream(silence, 16000, speedup=1.0)
            sent.append(silence)
        session.send({"type": "input_audio_buffer.commit"})
        completed = session.wait_for("conversation.item.input_audio_transcription.completed")[0]
    finally:
        session.ws.close()
    upload = client.audio.transcriptions.create(
        model="whisper-1", file=("clip.wav", wav(np.concatenate(sent))), language="en"
    )
    assert completed["transcript"] == upload.text
    kinds = session.kinds()
    committed_at = kinds.index("input_audio_buffer.committed")
    assert "conversation.item.input_audio_transcription.partial" in kinds[:committed_at]
    assert kinds.index("conversation.item.input_audio_transcription.delta") > committed_at
    partials = session.of_type("conversation.item.input_audio_transcription.partial")
    assert {p["item_id"] for p in partials} == {completed["item_id"]} and partials[-1]["transcript"]
    deltas = session.of_type("conversation.item.input_audio_transcription.delta")
    assert {d["item_id"] for d in deltas} == {completed["item_id"]}
    assert "".join(d["delta"] for d in deltas) == completed["transcript"]  # always, as OpenAI's clients add them
    metrics = completed["metrics"]
    assert metrics["latency_ms"] > 0 and metrics["tokens"] > 0 and completed["usage"]["seconds"] > 9


def test_realtime_server_vad_at_24khz(server: ServerProcess, client: OpenAI, speech: np.ndarray) -> None:
    silence = np.zeros(16000, dtype=np.int16)
    pcm16k = np.concatenate([silence, speech, silence, speech[: 16000 * 4], silence, silence])
    pcm24k = (soxr.resample(pcm16k.astype(np.float32), 16000, 24000)).round().clip(-32768, 32767).astype(np.int16)
    session = live(server)
    session.send(
        {
            "type": "session.update",
            "session": {
                "type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                    "transcription": {"model": "whisper-1", "language": "en"},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}},
            },
        }
    )  # fmt: skip
    assert session.wait_for("session.updated")[0]["session"]["audio"]["input"]["format"]["rate"] == 24000
    used_before = metric(server, "specwhisper_realtime_early_finals_total", 0.0, outcome="used")
    session.stream(pcm24k, 24000)
    completed = session.wait_for("conversation.item.input_audio_transcription.completed", count=2)
    started = session.wait_for("input_audio_buffer.speech_started", count=2)
    stopped = session.wait_for("input_audio_buffer.speech_stopped", count=2)
    assert [e["item_id"] for e in started] == [e["item_id"] for e in stopped] == [e["item_id"] for e in completed]
    assert 700 <= started[0]["audio_start_ms"] <= 1300 and stopped[0]["audio_end_ms"] > 10_000
    reference = words(client.audio.transcriptions.create(model="whisper-1", file=("c.wav", wav(speech))).text)
    first = words(completed[0]["transcript"])
    assert len(set(first) & set(reference)) >= 0.9 * len(set(reference))
    assert words(completed[1]["transcript"])[:3] == reference[:3]
    committed = session.wait_for("input_audio_buffer.committed", count=2)
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    session.ws.close()
    # Both finals were begun at the pause, before the VAD's stop (the same audio: what the stop would have sent).
    assert metric(server, "specwhisper_realtime_early_finals_total", 0.0, outcome="used") - used_before >= 2


GA_TYPES = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


def live_bytes(speech: np.ndarray, audio_format: str) -> bytes:
    """The 16-kHz clip as a client sends it: pcm16 at 24 kHz, or G.711 at 8 kHz (a phone line)."""
    audio = speech.astype(np.float32) / 32768.0
    if audio_format == "pcm16":
        up = soxr.resample(audio, 16000, 24000)
        return bytes((np.clip(up, -1, 32767 / 32768) * 32768).round().astype("<i2").tobytes())
    out = io.BytesIO()
    subtype = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}[audio_format]
    sf.write(out, soxr.resample(audio, 16000, 8000), 8000, format="RAW", subtype=subtype)
    return out.getvalue()


@pytest.mark.parametrize("shape", ["ga", "beta"])
def test_official_sdk_realtime_client_in_every_format(
    server: ServerProcess, client: OpenAI, speech: np.ndarray, shape: str
) -> None:
    """The `openai` SDK's own realtime clients (GA `client.realtime`, beta `client.beta.realtime`) configure a
    transcription session in pcm16, G.711 mu-law and A-law, append the clip, commit, and get its text: the same
    words as an upload of the clip (the phone line's narrower band may change a word)."""
    sdk = OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", websocket_base_url=server.url.replace("http", "ws") + "/v1"
    )
    upload = words(client.audio.transcriptions.create(model="whisper-1", file=("c.wav", wav(speech))).text)
    for audio_format in ("pcm16", "g711_ulaw", "g711_alaw"):
        transcription = {"model": "whisper-1", "language": "en"}
        if shape == "ga":
            manager: Any = sdk.realtime.connect(model="whisper-1")
            update = {"type": "transcription", "audio": {"input": {
                "format": {"type": GA_TYPES[audio_format]}, "transcription": transcription, "turn_detection": None,
                "noise_reduction": {"type": "near_field"}}}}  # fmt: skip
        else:
            manager = sdk.beta.realtime.connect(model="whisper-1")
            update = {"input_audio_format": audio_format, "input_audio_transcription": transcription,
                      "turn_detection": None, "input_audio_noise_reduction": {"type": "far_field"}}  # fmt: skip
        with manager as conn:  # the beta client sends `OpenAI-Beta: realtime=v1`
            assert conn.recv().type == ("session.created" if shape == "ga" else "transcription_session.created")
            if shape == "ga":
                conn.session.update(session=update)
            else:
                conn.transcription_session.update(session=update)
            updated = conn.recv()
            assert updated.type in ("session.updated", "transcription_session.updated"), updated
            data = live_bytes(speech, audio_format)
            step = len(data) // 20 // 2 * 2
            for start in range(0, len(data), step):
                conn.input_audio_buffer.append(audio=base64.b64encode(data[start : start + step]).decode())
            conn.input_audio_buffer.commit()
            heard: list[str] | None = None
            for event in conn:
                assert event.type != "error", event
                if event.type == "conversation.item.input_audio_transcription.completed":
                    heard = words(event.transcript)
                    break
        assert heard is not None, "the session ended without a completed transcription"
        same = sum(a == b for a, b in zip(heard, upload, strict=False))
        assert len(heard) == len(upload) and same >= len(upload) - 2, (audio_format, heard, upload)


def check_logprobs(entries: list[dict[str, Any]], text: str) -> None:
    """OpenAI's `logprobs` entries: the text's tokens in order (their bytes spell it), each log-probability <= 0."""
    assert entries and all(set(e) == {"token", "logprob", "bytes"} and e["logprob"] <= 0 for e in entries)
    assert b"".join(bytes(int(b) for b in e["bytes"]) for e in entries).decode().strip() == text  # SDK: floats
    assert "".join(e["token"] for e in entries).strip() == text  # no character split across tokens here


def test_logprobs_in_json_sse_and_realtime(server: ServerProcess, client: OpenAI, speech: np.ndarray) -> None:
    """include[]=logprobs (REST, through the SDK; and SSE) and include: [...logprobs] (realtime) give each text
    token's log-probability; the same audio gives the same tokens and values everywhere."""
    audio = wav(speech)
    answer = client.audio.transcriptions.create(
        model="whisper-1", file=("c.wav", audio), include=["logprobs"], response_format="json"
    )
    logprobs = [e.model_dump() for e in answer.logprobs or []]
    check_logprobs(logprobs, answer.text)
    streamed = client.audio.transcriptions.create(
        model="whisper-1", file=("c.wav", audio), include=["logprobs"], stream=True
    )
    deltas: list[dict[str, Any]] = []
    done: Any = None
    for event in streamed:
        if event.type == "transcript.text.delta":
            deltas += [e.model_dump() for e in event.logprobs or []]
        elif event.type == "transcript.text.done":
            done = event
    assert done is not None and done.text == answer.text
    assert [e.model_dump() for e in done.logprobs] == logprobs == deltas
    # Only json (and verbose_json) can carry them, as OpenAI says.
    refused = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "include[]": "logprobs", "response_format": "srt"},
        files={"file": ("c.wav", audio)},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include[]"

    session = live(server)
    try:
        session.wait_for("session.created")
        session.send({"type": "transcription_session.update", "session": {
            "input_audio_sample_rate": 16000, "turn_detection": None,
            "include": ["item.input_audio_transcription.logprobs"],
            "input_audio_transcription": {"model": "whisper-1"}}})  # fmt: skip
        assert session.wait_for("transcription_session.updated")[0]["session"]["include"] == [
            "item.input_audio_transcription.logprobs"
        ]
        session.stream(speech, 16000)
        session.send({"type": "input_audio_buffer.commit"})
        completed = session.wait_for("conversation.item.input_audio_transcription.completed")[0]
        deltas = session.of_type("conversation.item.input_audio_transcription.delta")
    finally:
        session.ws.close()
    check_logprobs(completed["logprobs"], completed["transcript"])
    if completed["transcript"] == answer.text:
        assert completed["logprobs"] == logprobs
    # The deltas spell the transcript, and carry the entries of the tokens that spell them.
    assert "".join(d["delta"] for d in deltas) == completed["transcript"]
    check_logprobs([e for d in deltas for e in d["logprobs"]], completed["transcript"])


def test_realtime_bad_events_get_errors_and_others_keep_working(server: ServerProcess, speech: np.ndarray) -> None:
    bad = live(server)
    bad.wait_for("session.created")
    bad.ws.send("{not json")
    bad.send({"type": "no.such.event", "event_id": "evt_1"})
    bad.send({"type": "input_audio_buffer.append", "audio": "%%%not base64%%%"})
    bad.ws.send(b"\x00\x01binary")
    bad.send({"type": "input_audio_buffer.append", "audio": ""})  # nothing to resample from 24 kHz: no error
    bad.send({"type": "input_audio_buffer.commit"})
    bad.send({"type": "transcription_session.update", "session": {"input_audio_format": "g729"}})
    bad.send(
        {
            "type": "transcription_session.update",
            "session": {"input_audio_transcription": {"model": "gpt-4o-transcribe-diarize"}},  # names speakers
        }
    )
    bad.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}}})  # fmt: skip
    bad.send({"type": "no.such.event", "event_id": {"not": "a string"}})
    errors = bad.wait_for("error", count=9)
    codes = [e["error"]["code"] for e in errors]
    assert codes == [
        "invalid_json",
        "invalid_event",
        "invalid_base64",
        "invalid_event",
        "input_audio_buffer_commit_empty",
        "invalid_value",
        "model_not_found",
        "invalid_value",
        "invalid_event",
    ]
    assert errors[7]["error"]["param"] == "session.audio.input.turn_detection.eagerness"
    assert errors[1]["error"]["event_id"] == "evt_1" and errors[8]["error"]["event_id"] is None
    good = live(server)  # a second session works while the first misbehaves
    good.send({"type": "transcription_session.update", "session": {"input_audio_sample_rate": 16000,
                                                                  "turn_detection": None}})  # fmt: skip
    bad.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 300_000}))  # over the event limit
    assert bad.wait_for("error", count=10)[-1]["error"]["code"] == "event_too_large"
    assert bad.closed.wait(10) and bad.ws.close_code == 1009
    good.send({"type": "input_audio_buffer.append", "audio": ""})  # no samples: opens no utterance
    good.send({"type": "input_audio_buffer.commit", "event_id": "evt_empty"})
    empty = good.wait_for("error")[0]["error"]
    assert (empty["code"], empty["event_id"]) == ("input_audio_buffer_commit_empty", "evt_empty")
    good.stream(speech[: 16000 * 3], 16000, speedup=10)
    good.send({"type": "input_audio_buffer.commit"})
    done = good.wait_for("conversation.item.input_audio_transcription.completed")[0]
    assert words(done["transcript"])[:1] == ["printing"]
    good.ws.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(server, "specwhisper_realtime_sessions") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("closed sessions are not released")
    assert metric(server, "specwhisper_realtime_utterance_latency_seconds_count") >= 1


strict_server = server_fixture(
    {"SPECWHISPER_API_KEYS": '["sk-live"]', "SPECWHISPER_REALTIME_MAX_BACKLOG_S": "5"}, name="streaming-strict"
)


def test_realtime_auth_and_backlog_limit(strict_server: ServerProcess, speech: np.ndarray) -> None:
    anonymous = live(strict_server)
    assert anonymous.wait_for("error")[0]["error"]["code"] == "invalid_api_key"
    assert anonymous.closed.wait(10) and anonymous.ws.close_code == 1008
    by_header = live(strict_server, additional_headers={"Authorization": "Bearer sk-live"})
    by_header.wait_for("session.created")
    by_header.ws.close()
    browser = live(strict_server, subprotocols=["realtime", "openai-insecure-api-key.sk-live"])  # type: ignore[list-item]
    browser.wait_for("session.created")
    assert browser.ws.subprotocol == "realtime"
    browser.send({"type": "transcription_session.update", "session": {"input_audio_sample_rate": 16000,
                                                                     "turn_detection": None}})  # fmt: skip
    browser.stream(speech[: 16000 * 8], 16000, speedup=100)  # 8 s at once: over the 5-s backlog
    assert browser.wait_for("error")[0]["error"]["code"] == "input_audio_buffer_overflow"
    assert browser.closed.wait(10) and browser.ws.close_code == 1008


def test_realtimebench_measures_a_live_session(server: ServerProcess, benchdata: Path) -> None:
    """`python -m app realtimebench`'s measurement on a running server: one A-law session with semantic VAD, one
    clip with a pause put inside it, in real time; every clip gets its final, with its last word, and each figure
    it reports is there."""
    from app.tools.realtimebench import run_realtime_bench

    report = run_realtime_bench(
        benchdata / "manifest.jsonl", [1], ["g711_alaw"], 1, 500, server.url, ("semantic_vad",), pause_ms=800
    )
    (level,) = report["levels"]
    assert level["turn_detection"] == "semantic_vad" and report["pause_ms"] == 800
    assert level["missing_finals"] == 0 and level["wer"] <= 0.3, level
    assert level["clips_losing_last_word"] == 0 and level["turns_cut_within_clips"] >= 0, level
    for figure in ("speech_end_to_speech_stopped_s", "speech_end_to_completed_s", "speech_start_to_first_delta_s"):
        assert level[figure]["n"] == 1 and level[figure]["p50"] > 0, level
