"""Property-based fuzzing of everything a client controls: audio bytes, form fields, WebSocket frames.

In process: `decode_audio` on generated, truncated and corrupted WAV/FLAC/OGG/MP3/AIFF/... files, random
bytes, NaN/Inf floats, 1-8 channels, 1 Hz..400 kHz: it returns finite 16-kHz mono samples or raises
AudioError, nothing else. Against one real server: generated uploads with generated parameters and
prompts, and generated WebSocket frames: every answer is a 4xx with OpenAI's error JSON or a valid
result, never a 5xx or an internal error, and a known-good request still works afterwards.

The number of generated cases is `SPECWHISPER_FUZZ_CASES` (default 400, split over the properties);
the long run is `SPECWHISPER_FUZZ_CASES=10000 pytest tests/test_fuzz.py`.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.api.audio import SAMPLE_RATE, AudioError, AudioTooLongError, decode_audio
from app.tools.scrape import scrape_metrics
from tests.server import ServerProcess, post, server_fixture

CASES = int(os.environ.get("SPECWHISPER_FUZZ_CASES", "400"))
SHARE = {"decode": 0.5, "upload": 0.3, "realtime": 0.2}  # of CASES, per property


def fuzz_settings(kind: str) -> settings:
    return settings(
        max_examples=max(10, int(CASES * SHARE[kind])),
        deadline=None,
        derandomize=os.environ.get("SPECWHISPER_FUZZ_SEED") is None,  # reproducible in CI unless a seed is asked
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
        database=None,
        print_blob=True,
    )


# -- generated audio files ---------------------------------------------------------------------------------
CONTAINERS = [
    ("WAV", "PCM_16"),
    ("WAV", "PCM_24"),
    ("WAV", "PCM_U8"),
    ("WAV", "FLOAT"),
    ("WAV", "DOUBLE"),
    ("WAV", "ULAW"),
    ("WAV", "IMA_ADPCM"),
    ("RF64", "PCM_16"),
    ("FLAC", "PCM_16"),
    ("FLAC", "PCM_24"),
    ("OGG", "VORBIS"),
    ("OGG", "OPUS"),
    ("MP3", "MPEG_LAYER_III"),
    ("AIFF", "PCM_16"),
    ("CAF", "FLOAT"),
    ("AU", "PCM_16"),
]
RATES = [8000, 11025, 16000, 22050, 44100, 48000, 96000, 192000]
LOSSY = ("MP3", "OGG")  # encoded by LAME, libvorbis, libopus
MAGIC = [b"RIFF", b"RIFF\xff\xff\xff\xffWAVEfmt ", b"fLaC", b"OggS", b"ID3\x04", b"\xff\xfb\x90", b"FORM", b"caff",
         b".snd", b"RF64", b"\x1aE\xdf\xa3", b"\x00\x00\x00\x20ftypM4A "]  # fmt: skip


class Blob(bytes):
    """Bytes with a short repr: failing cases print their shape, not 200 kB of audio."""

    def __repr__(self) -> str:
        return f"Blob({len(self)} bytes: {bytes(self[:16])!r}...)"


def encode(samples: np.ndarray, rate: int, container: str, subtype: str) -> bytes | None:
    buf = io.BytesIO()
    try:
        sf.write(buf, samples, rate, format=container, subtype=subtype)
    except Exception:  # this container refuses the rate or channel count: not a case
        return None
    return buf.getvalue()


@st.composite
def audio_files(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A small encoded file, maybe corrupted; the dict says what it is (for stronger checks when intact)."""
    container, subtype = draw(st.sampled_from(CONTAINERS))
    rate = draw(st.one_of(st.sampled_from(RATES), st.integers(1, 400_000)))
    channels = draw(st.sampled_from([1, 1, 2, 8]))
    frames = draw(st.one_of(st.integers(0, 4), st.integers(0, 2000)))
    kind = draw(st.sampled_from(["zeros", "sine", "noise", "loud", "nan", "inf"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "zeros":
        samples = np.zeros((frames, channels))
    elif kind == "sine":
        samples = np.tile(0.5 * np.sin(np.arange(frames) / 5.0)[:, None], (1, channels))
    elif kind == "noise":
        samples = rng.uniform(-1, 1, (frames, channels))
    elif kind == "loud":
        samples = rng.uniform(-1e30, 1e30, (frames, channels))
    else:
        samples = rng.uniform(-1, 1, (frames, channels))
        if frames:
            samples[rng.integers(0, frames), rng.integers(0, channels)] = np.nan if kind == "nan" else np.inf
    if subtype not in ("FLOAT", "DOUBLE"):
        # Only float files can hold NaN, Inf or 1e30, and libsndfile's *encoders* crash the test process
        # on them (u-law: segfault; LAME: assert); integer files get full scale, as a clipping writer does.
        samples = np.clip(np.nan_to_num(samples, posinf=1.0, neginf=-1.0), -1.0, 1.0)
    if container in LOSSY and rate not in RATES[:-2]:
        rate = 16000  # libvorbis segfaults at 300 kHz and more; odd rates stay covered by the PCM containers
    data = encode(samples.astype(np.float64), rate, container, subtype)
    if data is None:
        data = encode(np.zeros((max(frames, 1), 1)), 16000, "WAV", "PCM_16")
        assert data is not None
        container, subtype, rate, channels, kind = "WAV", "PCM_16", 16000, 1, "zeros"
        frames = max(frames, 1)
    mutation = draw(st.sampled_from(["none", "truncate", "flip", "huge", "append", "cut_header"]))
    data = mutate(draw, data, mutation)
    info = {"container": container, "subtype": subtype, "rate": rate, "channels": channels, "frames": frames,
            "kind": kind, "mutation": mutation}  # fmt: skip
    return data, info


def mutate(draw: st.DrawFn, data: bytes, mutation: str) -> bytes:
    if mutation == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if mutation == "cut_header":
        return data[: draw(st.integers(0, min(len(data), 64)))]
    if mutation == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, min(len(out), 128) - 1)) if out else 0
            if out:
                out[at] = draw(st.integers(0, 255))
        return bytes(out)
    if mutation == "huge":  # a size/length field claiming gigabytes
        out = bytearray(data)
        if len(out) >= 8:
            at = draw(st.integers(0, min(len(out), 96) - 4))
            out[at : at + 4] = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80"]))
        return bytes(out)
    if mutation == "append":
        return data + draw(st.binary(min_size=1, max_size=512))
    return data


random_bytes = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda magic, rest: magic + rest, st.sampled_from(MAGIC), st.binary(max_size=2048)),
)
any_audio = st.one_of(audio_files(), random_bytes.map(lambda b: (b, {"mutation": "random"})))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # nothing swallowed in callbacks
@fuzz_settings("decode")
@given(any_audio)
def test_decode_audio_returns_samples_or_audio_error(case: tuple[bytes, dict[str, Any]]) -> None:
    data, info = case
    try:
        audio = decode_audio(data, max_seconds=60)
    except AudioError:
        intact = info["mutation"] == "none" and info.get("container") in ("WAV", "FLAC", "AIFF", "RF64")
        lossless_ok = info.get("kind") in ("zeros", "sine", "noise") and info.get("subtype") != "IMA_ADPCM"
        seconds = info["frames"] / info["rate"] if intact else 0.0
        if intact and lossless_ok and seconds * SAMPLE_RATE >= 2 and seconds <= 60:
            raise  # an intact, finite, lossless file within the limit must decode
        return
    assert isinstance(audio, np.ndarray) and audio.dtype == np.float32 and audio.ndim == 1
    assert audio.size > 0 and np.all(np.isfinite(audio))
    assert audio.size <= 60 * SAMPLE_RATE + 16
    sample_exact = info.get("container") in ("WAV", "FLAC") and info.get("subtype") != "IMA_ADPCM"  # ADPCM: blocks
    if info["mutation"] == "none" and sample_exact and info["rate"] <= 400_000:
        assert abs(audio.size - info["frames"] * SAMPLE_RATE / info["rate"]) <= 2


def _silence_flac(seconds: int, rate: int, channels: int, path: Path) -> bytes:
    block = np.zeros((rate * 10, channels), dtype=np.int16)
    with sf.SoundFile(path, "w", rate, channels, format="FLAC", subtype="PCM_16") as out:
        for _ in range(seconds // 10):
            out.write(block)
    return path.read_bytes()


def test_two_hours_of_silence_hit_the_duration_limit_not_memory(tmp_path: Path) -> None:
    data = _silence_flac(2 * 3600, 8000, 1, tmp_path / "silence.flac")
    assert len(data) < 5_000_000  # a small upload ...
    tracemalloc.start()
    try:
        with pytest.raises(AudioTooLongError):
            decode_audio(data, max_seconds=3600)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, f"refused only after allocating {peak / 1e6:.0f} MB"  # ... refused from its header


def test_many_channels_at_a_high_rate_decode_in_bounded_memory(tmp_path: Path) -> None:
    """A decompression bomb: 8 channels at 192 kHz are 740 MB of float32 per 2 minutes, from a few hundred kB."""
    data = _silence_flac(120, 192_000, 8, tmp_path / "bomb.flac")
    assert len(data) < 2_000_000
    tracemalloc.start()
    try:
        audio = decode_audio(data, max_seconds=3600)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert audio.size == 120 * SAMPLE_RATE
    assert peak < 120_000_000, f"peak {peak / 1e6:.0f} MB: the file was expanded at its own rate"


# -- against the real server ---------------------------------------------------------------------------------
server = server_fixture(
    {
        "SPECWHISPER_MAX_UPLOAD_BYTES": "300000",
        "SPECWHISPER_MAX_AUDIO_SECONDS": "30",
        "SPECWHISPER_REALTIME_MAX_EVENT_BYTES": "65536",
        "SPECWHISPER_BATCH_WINDOW_MS": "0",
    },
    name="fuzz",
    clean_log=True,
)


@pytest.fixture(scope="module")
def speech(benchdata: Path) -> bytes:
    return (benchdata / "audio/ljspeech/LJ001-0002.wav").read_bytes()  # 1.9 s: "in being comparatively modern."


def known_good(server: ServerProcess, speech: bytes) -> None:
    r = post(server, speech)
    assert r.status_code == 200 and r.json()["text"] == "in being comparatively modern."


def assert_openai_error(r: httpx.Response) -> None:
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert error["type"] in ("invalid_request_error", "rate_limit_error")


text_values = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=500, max_size=3000),
    st.binary(max_size=64),  # not UTF-8: sent as raw bytes
)
fields = {
    "model": st.one_of(st.sampled_from(["whisper-1", "whisper-1", "whisper-base", "", "whisper-2"]), text_values),
    "language": st.one_of(st.none(), st.sampled_from(["en", "EN ", "xx", "zz-top", "de", ""]), text_values),
    "prompt": st.one_of(st.none(), text_values),
    "response_format": st.one_of(st.sampled_from(["json", "text", "srt", "vtt", "verbose_json", "xml"]), text_values),
    "temperature": st.one_of(
        st.sampled_from(["0", "0.0", "1", "-1", "1e309", "nan", "inf", "-0", "0x1", "warm"]),
        st.floats(allow_nan=True).map(repr),
    ),
    "speculative": st.sampled_from(["true", "false", "1", "0", "yes", "maybe", ""]),
    "stream": st.sampled_from(["false", "true", "1", "nope"]),
}

sane_fields = {
    "model": st.sampled_from(["whisper-1", "whisper-base"]),
    "language": st.sampled_from(["en", "de", ""]),
    "prompt": st.text(max_size=40),
    "response_format": st.sampled_from(["json", "text", "srt", "vtt", "verbose_json"]),
    "temperature": st.sampled_from(["0", "0.0", "0.5", "1"]),
    "speculative": st.sampled_from(["true", "false"]),
}


@st.composite
def uploads(draw: st.DrawFn, speech: bytes) -> dict[str, Any]:
    if draw(st.integers(0, 3)) == 0:  # sane parameters: the audio decides
        form = {k: draw(v) for k, v in sane_fields.items() if draw(st.booleans()) or k == "model"}
        grans = ["word"] if form.get("response_format") == "verbose_json" and draw(st.booleans()) else []
    else:
        form = {k: draw(v) for k, v in fields.items() if draw(st.booleans()) or k == "model"}
        grans = draw(st.lists(st.sampled_from(["segment", "word", "char", ""]), max_size=3))
    which = draw(st.integers(0, 9))
    if which == 0:
        audio = speech  # real speech: the valid case, with whatever parameters came along
    elif which == 1:
        audio = mutate(draw, speech, draw(st.sampled_from(["truncate", "flip", "huge", "cut_header"])))
    else:
        audio = draw(any_audio)[0]
    name = draw(st.sampled_from(["a.wav", "a.flac", "a.mp3", "a.ogg", "a.m4a", "a.webm", "a.txt", "", "../../etc/x"]))
    ctype = draw(st.sampled_from([None, "audio/wav", "application/octet-stream", "text/plain", "image/png", "x/y"]))
    with_file = draw(st.integers(0, 19)) != 0  # sometimes no file at all
    return {"form": form, "grans": grans, "audio": Blob(audio), "name": name, "ctype": ctype, "with_file": with_file}


def _multipart(case: dict[str, Any]) -> list[tuple[str, Any]]:
    parts: list[tuple[str, Any]] = []
    for key, value in case["form"].items():
        if value is None:
            continue
        parts.append((key, (None, value if isinstance(value, bytes) else value.encode())))
    for g in case["grans"]:
        parts.append(("timestamp_granularities[]", (None, g.encode())))
    if case["with_file"]:
        file = (case["name"], case["audio"]) if case["ctype"] is None else (case["name"], case["audio"], case["ctype"])
        parts.append(("file", file))
    return parts


def check_upload_answer(r: httpx.Response, case: dict[str, Any]) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.status_code in (400, 404, 413, 415, 429), (r.status_code, r.text[:500])
        assert_openai_error(r)
        return
    assert r.status_code == 200
    kind = r.headers["content-type"]
    if kind.startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["type"] in ("transcript.text.done", "error"), r.text[:500]
    elif kind.startswith("application/json"):
        assert isinstance(r.json()["text"], str)
    else:
        assert kind.startswith(("text/plain", "text/vtt"))


@pytest.mark.timeout(1800)
def test_generated_uploads_get_a_result_or_an_openai_error(server: ServerProcess, speech: bytes) -> None:
    url = f"{server.url}/v1/audio/transcriptions"
    seen: dict[int, int] = {}

    @fuzz_settings("upload")
    @given(uploads(speech))
    def run(case: dict[str, Any]) -> None:
        r = httpx.post(url, files=_multipart(case), timeout=300)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        check_upload_answer(r, case)

    run()
    print("upload statuses:", dict(sorted(seen.items())))
    assert seen.get(200) and seen.get(400), seen  # both paths were exercised
    known_good(server, speech)


def test_absurd_requests_outside_the_form(server: ServerProcess, speech: bytes) -> None:
    url = f"{server.url}/v1/audio/transcriptions"
    cases = [
        httpx.post(url, content=b"--x\r\nbroken", headers={"Content-Type": "multipart/form-data; boundary=x"}),
        httpx.post(url, content=b"garbage", headers={"Content-Type": "multipart/form-data"}),
        httpx.post(url, content=b"{}", headers={"Content-Type": "application/json"}),
        httpx.post(url, data={"model": "whisper-1"}),  # multipart without a file
        httpx.post(url, data={"model": "whisper-1", "file": "not a file"}),
        httpx.post(url, files={"file": ("a.wav", speech)}, data={"model": "whisper-1", "temperature": "1" * 5000}),
        httpx.get(url),
        httpx.post(f"{server.url}/v1/no/such/route"),
        httpx.delete(f"{server.url}/v1/models/whisper-1"),
        httpx.post(url, content=b"x" * 400_000, headers={"Content-Type": "multipart/form-data; boundary=x"}),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, r.text
    assert cases[-1].status_code == 413
    known_good(server, speech)


def test_chunked_upload_over_the_limit_is_refused_while_streaming(server: ServerProcess, speech: bytes) -> None:
    """No Content-Length: the size limit is enforced on the bytes as they arrive, before any parsing."""
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        yield b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        for _ in range(1000):  # up to 64 MB: the server must stop us long before
            sent += 65536
            yield b"\0" * 65536

    try:
        r = httpx.post(
            f"{server.url}/v1/audio/transcriptions",
            content=body(),
            headers={"Content-Type": "multipart/form-data; boundary=b"},
            timeout=60,
        )
    except httpx.HTTPError:  # the server may close the connection before reading everything
        pass
    else:
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    assert sent < 64 * 1000 * 1024
    known_good(server, speech)


# -- WebSocket frames -----------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
EVENT_TYPES = ["transcription_session.update", "session.update", "input_audio_buffer.append",
               "input_audio_buffer.clear", "input_audio_buffer.commit", "response.create", ""]  # fmt: skip
session_values = st.fixed_dictionaries(
    {},
    optional={
        "input_audio_format": st.one_of(st.sampled_from(["pcm16", "g711_ulaw", "g711_alaw"]), json_values),
        "input_audio_noise_reduction": st.one_of(
            st.none(), json_values, st.fixed_dictionaries({"type": st.sampled_from(["near_field", "far_field", "x"])})
        ),
        "include": st.one_of(st.just(["item.input_audio_transcription.logprobs"]), json_values),
        "input_audio_sample_rate": st.one_of(st.sampled_from([16000, 24000, 8000, 0, -1, 1e9, True]), json_values),
        "input_audio_transcription": st.one_of(
            json_values,
            st.fixed_dictionaries({}, optional={"model": json_values, "language": json_values, "prompt": json_values}),
        ),
        "turn_detection": st.one_of(
            st.none(),
            json_values,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["server_vad", "semantic_vad"])},
                optional={k: json_values for k in ("threshold", "prefix_padding_ms", "silence_duration_ms")},
            ),
        ),
        "type": st.sampled_from(["transcription", "realtime"]),
        "audio": json_values,
    },
)


@st.composite
def frames(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=200))  # mostly not JSON
    if kind == 1:
        return draw(st.binary(max_size=200))  # binary frame
    if kind == 2:
        return json.dumps(draw(json_values))
    if kind == 3:  # append with bad or odd-length base64, or a tiny valid chunk
        encoded = st.binary(max_size=99).map(lambda b: base64.b64encode(b).decode())
        audio = draw(st.one_of(st.text(max_size=50), encoded))
        return json.dumps({"type": "input_audio_buffer.append", "audio": audio})
    if kind == 4:
        kind_name = draw(st.sampled_from(["transcription_session.update", "session.update"]))
        return json.dumps({"type": kind_name, "session": draw(st.one_of(session_values, json_values))})
    if kind == 5:  # over the 64-kB event limit: the session is closed with 1009
        return json.dumps({"type": "input_audio_buffer.append", "audio": "A" * draw(st.integers(70_000, 200_000))})
    event = {"type": draw(st.sampled_from(EVENT_TYPES)), "event_id": draw(json_values)}
    event.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=3)))
    if event["type"] == "input_audio_buffer.commit" and draw(st.integers(0, 3)):
        event["type"] = "input_audio_buffer.clear"  # commits of real audio cost a transcription: keep them rare
    return json.dumps(event)


KNOWN_EVENTS = {
    "session.created", "transcription_session.created", "transcription_session.updated", "session.updated", "error",
    "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
    "input_audio_buffer.cleared", "conversation.item.input_audio_transcription.delta",
    "conversation.item.input_audio_transcription.partial",
    "conversation.item.input_audio_transcription.completed", "conversation.item.input_audio_transcription.failed",
}  # fmt: skip


def play(ws_url: str, messages: list[str | bytes]) -> None:
    """Send the frames, then `clear` as a marker; read until its `cleared` answer or a close."""
    with connect(ws_url, max_size=None, open_timeout=30) as ws:
        closed = None
        try:
            for m in messages:
                ws.send(m)
            ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "marker"}))
            while True:
                event = json.loads(ws.recv(timeout=120))
                assert event["type"] in KNOWN_EVENTS, event
                if event["type"] == "error":
                    error = event["error"]
                    assert {"type", "code", "message", "param"} <= set(error) and error["code"], event
                    assert len(error["message"]) <= 600
                if event["type"] == "input_audio_buffer.cleared":
                    return
        except ConnectionClosed as exc:
            closed = exc
        assert closed is not None and closed.rcvd is not None, "closed without a close frame"
        assert closed.rcvd.code in (1008, 1009), closed  # never 1011 (internal error)


@pytest.mark.timeout(1800)
def test_generated_websocket_frames_get_events_or_errors(server: ServerProcess, speech: bytes) -> None:
    ws_url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"

    @fuzz_settings("realtime")
    @given(st.lists(frames(), min_size=1, max_size=6))
    def run(messages: list[str | bytes]) -> None:
        play(ws_url, messages)

    run()
    known_good(server, speech)
    assert "specwhisper_realtime_errors_total" in scrape_metrics(server.url)
