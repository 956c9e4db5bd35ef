"""Uploads with `chunking_strategy` on the real server, through the official client: speech between silence,
noise and music is found by the VAD, decoded in batches, and timed on the upload's timeline."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest
import soundfile as sf
import soxr
from openai import OpenAI

from app.tools.bench import error_rate
from app.tools.manifest import ManifestClip
from tests.server import ServerProcess, metric, openai_client, server_fixture

SR = 16000
FIRST, SECOND = "ljspeech/LJ001-0001", "ljspeech/LJ001-0002"

# The operator's default is `auto` here: requests that say nothing are chunked.
server = server_fixture({"SPECWHISPER_DEFAULT_CHUNKING_STRATEGY": "auto", "SPECWHISPER_BATCH_WINDOW_MS": "50"})


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return openai_client(server)


def _wav(audio: np.ndarray) -> bytes:
    out = io.BytesIO()
    sf.write(out, audio, SR, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _noise(seconds: float, level: float) -> np.ndarray:
    return np.random.default_rng(1).normal(0, level, int(seconds * SR)).astype(np.float32)


@pytest.fixture(scope="module")
def meeting(clip: Callable[[str], np.ndarray]) -> tuple[bytes, list[tuple[float, float]]]:
    """Silence, speech, loud noise, speech, silence; and where the speech is (s)."""
    a, b = clip(FIRST), clip(SECOND)
    parts = [np.zeros(5 * SR, np.float32), a, _noise(10, 0.05), b, np.zeros(5 * SR, np.float32)]
    t1 = 5 + a.size / SR
    t2 = t1 + 10
    return _wav(np.concatenate(parts)), [(5.0, t1), (t2, t2 + b.size / SR)]


def _inside(t: float, spans: list[tuple[float, float]], slack: float = 0.8) -> bool:
    return any(a - slack <= t <= b + slack for a, b in spans)


def test_speech_between_silence_and_noise(
    client: OpenAI, meeting: tuple[bytes, list[tuple[float, float]]], manifest: dict[str, ManifestClip]
) -> None:
    data, spans = meeting
    reference = f"{manifest[FIRST].text} {manifest[SECOND].text}"
    for strategy in ("auto", {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 300}):
        r = client.audio.transcriptions.create(
            model="whisper-1",
            file=("meeting.wav", data),
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
            chunking_strategy=strategy,  # type: ignore[arg-type]
        )
        assert error_rate([(reference, r.text, "en")]) < 0.1, r.text
        assert r.segments and r.words and r.duration == pytest.approx(spans[1][1] + 5, abs=0.01)
        for s in r.segments:
            assert _inside(s.start, spans) and _inside(s.end, spans) and s.start <= s.end <= r.duration
        for w in r.words:
            assert _inside(w.start, spans) and _inside(w.end, spans) and w.start <= w.end <= r.duration
        assert r.words[0].word.strip().startswith("Printing") and r.words[0].start >= spans[0][0] - 0.8


def test_quiet_voices_between_loud_ones_are_written(
    client: OpenAI, clip: Callable[[str], np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """Two FLEURS readers 40-45 dB below JFK and LJSpeech's reader, each after half a second of silence: the VAD
    did not hear them beside the loud voices, and Whisper left out what it did hear, until "auto" levelled the
    VAD's input locally and each chunk's voices towards its loudest (`leveling`): WER 0.65 -> 0.08."""
    voices = ["whisper/jfk", "fleurs/fleurs-en-002", FIRST, "fleurs/fleurs-en-004"]
    pause = np.zeros(SR // 2, np.float32)
    data = _wav(np.concatenate([x for v in voices for x in (clip(v), pause)]))
    reference = " ".join(manifest[v].text for v in voices)
    text = client.audio.transcriptions.create(model="whisper-1", file=("four.wav", data), chunking_strategy="auto").text
    assert error_rate([(reference, text, "en")]) < 0.2, text


def test_readings_whisper_wrote_short_are_decoded_again_in_halves(
    server: ServerProcess, client: OpenAI, clip: Callable[[str], np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """Three FLEURS readings 11-15 s apart make one chunk, of which Whisper wrote the first reading and ended
    (`bench-audio`'s long pauses; WER 0.75 here): the chunk is decoded again in halves (`shortfall`). A diarized
    request gets the same words."""
    voices = ["fleurs/fleurs-en-000", "fleurs/fleurs-en-001", "fleurs/fleurs-en-002"]
    pauses = [np.zeros(int(s * SR), np.float32) for s in (2.0, 10.7, 14.9, 2.0)]
    data = _wav(np.concatenate([pauses[0]] + [x for k, v in enumerate(voices) for x in (clip(v), pauses[k + 1])]))
    reference = " ".join(manifest[v].text for v in voices)
    kept = metric(server, "specwhisper_chunks_decoded_again_total", 0.0, kept="true")
    text = client.audio.transcriptions.create(model="whisper-1", file=("three.wav", data), language="en").text
    assert error_rate([(reference, text, "en")]) < 0.2, text
    assert metric(server, "specwhisper_chunks_decoded_again_total", kept="true") > kept
    diarized = client.audio.transcriptions.create(
        model="whisper-1", file=("three.wav", data), language="en", response_format="diarized_json"
    )
    assert diarized.text == text


def test_non_speech_gives_no_text(client: OpenAI, clip: Callable[[str], np.ndarray]) -> None:
    t = np.arange(30 * SR) / SR
    tones = (0.2 * np.sin(2 * np.pi * 330 * t) * (1 + np.sin(2 * np.pi * 2 * t))).astype(np.float32)
    for audio in (np.zeros(30 * SR, np.float32), _noise(30, 0.1), tones):
        r = client.audio.transcriptions.create(model="whisper-1", file=("x.wav", _wav(audio)))  # the default: auto
        assert r.text == ""
        verbose = client.audio.transcriptions.create(
            model="whisper-1", file=("x.wav", _wav(audio)), response_format="verbose_json"
        )
        assert verbose.segments == [] and verbose.duration == pytest.approx(30.0)


def test_long_audio_is_decoded_in_batches_and_streams(
    client: OpenAI, clip: Callable[[str], np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """Over 30 s of speech makes several chunks, queued together: they share batches; SSE sends each in order."""
    english = [c for c in manifest.values() if c.language == "en" and c.subset == "short"][:12]
    pause = np.zeros(2 * SR, np.float32)
    data = _wav(np.concatenate([x for c in english for x in (clip(c.id), pause)]))  # ~100 s
    r = client.audio.transcriptions.create(model="whisper-1", file=("long.wav", data), response_format="verbose_json")
    metrics = r.model_extra["metrics"]  # type: ignore[index]
    assert metrics["batch_size"] >= 2
    assert error_rate([(" ".join(c.text for c in english), r.text, "en")]) < 0.1, r.text
    starts = [s.start for s in r.segments]
    assert starts == sorted(starts) and r.segments[-1].end <= r.duration
    deltas, done = [], None
    for event in client.audio.transcriptions.create(
        model="whisper-1", file=("long.wav", data), stream=True, chunking_strategy="auto"
    ):
        if event.type == "transcript.text.delta":
            deltas.append(event.delta)
        elif event.type == "transcript.text.done":
            done = event.text
    plain = client.audio.transcriptions.create(model="whisper-1", file=("long.wav", data))
    assert len(deltas) >= 2 and "".join(deltas) == done == plain.text


def test_a_client_that_leaves_stops_its_chunks(
    server: ServerProcess, client: OpenAI, clip: Callable[[str], np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """Chunks are found and queued as the decoding goes: a client that leaves after the first delta of a
    ~6-min upload (>= 10 chunks) leaves at most the two batches already queued decoded, and no task behind."""
    english = [c for c in manifest.values() if c.language == "en" and c.subset == "short"][:16]
    pause = np.zeros(3 * SR, np.float32)
    speech = [clip(c.id) for c in english] * 3
    assert sum(s.size for s in speech) > 10 * 30 * SR
    data = _wav(np.concatenate([x for s in speech for x in (s, pause)]))
    client.audio.transcriptions.create(model="whisper-1", file=("warm.wav", _wav(speech[0])))
    tasks, jobs = metric(server, "specwhisper_asyncio_tasks"), metric(server, "specwhisper_batch_size_sum")
    fields = {"model": "whisper-1", "stream": "true", "chunking_strategy": "auto"}
    url = f"{server.url}/v1/audio/transcriptions"
    with httpx.stream("POST", url, data=fields, files={"file": ("long.wav", data)}, timeout=300) as r:
        assert r.status_code == 200
        assert any("transcript.text.delta" in line for line in r.iter_lines())  # the first delta, then away
    deadline = time.monotonic() + 60
    while metric(server, "specwhisper_asyncio_tasks") > tasks and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(server, "specwhisper_asyncio_tasks") <= tasks
    time.sleep(2)  # a batch that was still running has finished by now
    assert metric(server, "specwhisper_batch_size_sum") - jobs <= 8
    after = client.audio.transcriptions.create(model="whisper-1", file=("again.wav", _wav(speech[0])))
    assert error_rate([(english[0].text, after.text, "en")]) < 0.2


def test_single_block_when_asked(client: OpenAI, meeting: tuple[bytes, list[tuple[float, float]]]) -> None:
    """`none` (ours: OpenAI has no name for it) overrides the operator's default: one block, from 0 s."""
    r = client.audio.transcriptions.create(
        model="whisper-1",
        file=("meeting.wav", meeting[0]),
        response_format="verbose_json",
        chunking_strategy="none",  # type: ignore[arg-type]
        temperature=0.0,
    )
    assert r.segments[0].start == 0.0 and r.segments[0].seek == 0


def test_the_forms_of_chunking_strategy(
    server: ServerProcess, meeting: tuple[bytes, list[tuple[float, float]]]
) -> None:
    """As the SDK sends an object (`chunking_strategy[key]` fields), as JSON, and bad values: 400 naming the field."""
    url = f"{server.url}/v1/audio/transcriptions"
    files = {"file": ("m.wav", meeting[0])}
    as_json = {"model": "whisper-1", "chunking_strategy": json.dumps({"type": "server_vad", "prefix_padding_ms": 200})}
    assert "Printing" in httpx.post(url, data=as_json, files=files, timeout=300).json()["text"]
    cases = [
        (
            {"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "high"},
            "chunking_strategy.threshold",
        ),
        (
            {"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "1.5"},
            "chunking_strategy.threshold",
        ),
        ({"chunking_strategy[type]": "semantic_vad"}, "chunking_strategy.type"),
        ({"chunking_strategy[type]": "server_vad", "chunking_strategy[pad]": "1"}, "chunking_strategy.pad"),
        ({"chunking_strategy": "sometimes"}, "chunking_strategy"),
        ({"chunking_strategy": "{not json"}, "chunking_strategy"),
        ({"chunking_strategy": "auto", "chunking_strategy[type]": "server_vad"}, "chunking_strategy"),
        ({"chunking_strategy": "auto", "clip_timestamps": "0,5"}, "clip_timestamps"),
    ]
    for fields, param in cases:
        response = httpx.post(url, data={"model": "whisper-1", **fields}, files=files, timeout=60)
        assert response.status_code == 400, fields
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", fields


def _encoded(audio: np.ndarray, rate: int, subtype: str, channels: int = 1) -> bytes:
    resampled = soxr.resample(audio, SR, rate).astype(np.float32) if rate != SR else audio
    frames = np.stack([resampled, 0.5 * resampled], axis=1) if channels == 2 else resampled
    out = io.BytesIO()
    sf.write(out, frames, rate, format="WAV", subtype=subtype)
    return out.getvalue()


def test_phone_and_browser_audio(
    client: OpenAI, clip: Callable[[str], np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """8-kHz telephone audio (G.711 mu-law and A-law WAV), stereo at 44.1 kHz, a very quiet, a clipped and a
    DC-shifted recording: each is transcribed, in one block and chunked (where `auto` must level the quiet one
    for the VAD to hear it), with times inside the audio."""
    speech = clip(FIRST)
    padded = np.concatenate([np.zeros(2 * SR, np.float32), speech, np.zeros(3 * SR, np.float32)])
    cases = {
        "mu-law 8 kHz": _encoded(padded, 8000, "ULAW"),
        "A-law 8 kHz": _encoded(padded, 8000, "ALAW"),
        "stereo 44.1 kHz": _encoded(padded, 44100, "PCM_16", channels=2),
        "quiet (-50 dB)": _encoded(padded * 0.003, SR, "PCM_16"),
        "clipped": _encoded(np.clip(padded * 4, -1, 1), SR, "PCM_16"),
        "DC offset": _encoded(np.clip(padded * 0.5 + 0.3, -1, 1), SR, "FLOAT"),
    }
    for name, data in cases.items():
        for strategy in ("none", "auto"):
            r = client.audio.transcriptions.create(
                model="whisper-1",
                file=("phone.wav", data),
                response_format="verbose_json",
                timestamp_granularities=["word"],
                chunking_strategy=strategy,  # type: ignore[arg-type]
            )
            assert error_rate([(manifest[FIRST].text, r.text, "en")]) < 0.1, (name, strategy, r.text)
            assert r.words and all(w.end <= r.duration for w in r.words), (name, strategy)
            assert all(s.end <= r.duration for s in r.segments or []), (name, strategy)


def test_times_never_pass_the_end_of_the_audio(client: OpenAI, clip: Callable[[str], np.ndarray]) -> None:
    """Speech between long silences: decoded as one block, the last window's timestamps reach past the end of
    the audio (openai-whisper's transcribe() puts this one's last segment, words made up in the final
    silence, at 105.3-115.3 s of 109.3); they are clamped to it. Chunked, that silence gives no words."""
    speech, silence = clip(FIRST), np.zeros(SR, np.float32)
    audio = np.concatenate([*[silence] * 20, speech, *[silence] * 40, speech, *[silence] * 30])
    for strategy, granularities in (("none", ["segment"]), ("none", ["word"]), ("auto", ["word"])):
        r = client.audio.transcriptions.create(
            model="whisper-1",
            file=("pauses.wav", _wav(audio)),
            response_format="verbose_json",
            timestamp_granularities=granularities,  # type: ignore[arg-type]
            chunking_strategy=strategy,  # type: ignore[arg-type]
        )
        assert r.text.lower().count("printing") == 2 if strategy == "auto" else r.text.lower().count("printing") >= 2
        assert r.segments and all(s.start <= s.end <= r.duration for s in r.segments), strategy
        assert all(w.start <= w.end <= r.duration for w in r.words or []), strategy
