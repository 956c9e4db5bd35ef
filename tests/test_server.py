"""The real server on loopback: OpenAI client, errors, health, metrics, worker death, concurrency, shutdown."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from app.tools.scrape import sample_value, scrape_metrics
from tests.server import ServerProcess, metric, openai_client, post, server_fixture

JFK_START = "And so my fellow Americans"
# uvicorn re-raises SIGTERM after its graceful shutdown, so a drained server exits with -SIGTERM.
GRACEFUL = (0, -signal.SIGTERM)


# Speculation always: these tests check the speculative metrics (tests/test_adaptive.py covers adaptive).
server = server_fixture(
    {"SPECWHISPER_BATCH_WINDOW_MS": "300", "SPECWHISPER_SPECULATION": "always"}, expect_exit=GRACEFUL
)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def jfk(benchdata: Path) -> bytes:
    return (benchdata / "audio/whisper/jfk.wav").read_bytes()


def test_openai_client_formats(client: OpenAI, jfk: bytes) -> None:
    r = client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", jfk))
    assert r.text.startswith(JFK_START) and "ask not what your country" in r.text
    metrics = r.model_extra["metrics"]  # type: ignore[index]
    assert metrics["speculative"] is True and metrics["accepted"] > 0 and metrics["batch_size"] >= 1
    text = client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", jfk), response_format="text")
    assert text.strip() == r.text
    srt = client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", jfk), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> ")
    vtt = client.audio.transcriptions.create(model="whisper-1", file=("jfk.wav", jfk), response_format="vtt")
    assert vtt.startswith("WEBVTT")
    verbose = client.audio.transcriptions.create(
        model="whisper-1",
        file=("jfk.wav", jfk),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        language="en",
    )
    assert verbose.language == "english" and verbose.duration == pytest.approx(11.0)
    assert verbose.segments and verbose.segments[0].start == 0.0
    assert verbose.words and verbose.words[0].word == "And"


def test_translation_and_assistant_switch(client: OpenAI, benchdata: Path) -> None:
    german = (benchdata / "audio/fleurs/fleurs-de-001.wav").read_bytes()
    english = client.audio.translations.create(model="whisper-1", file=("de.wav", german))
    words = english.text.lower().split()
    assert sum(w in words for w in ("the", "a", "is", "he", "to", "of", "in", "and")) >= 2
    spec = client.audio.transcriptions.create(model="whisper-base", file=("de.wav", german), language="de")
    plain = client.audio.transcriptions.create(
        model="whisper-base", file=("de.wav", german), language="de", extra_body={"speculative": "false"}
    )
    assert spec.text == plain.text
    assert plain.model_extra["metrics"]["speculative"] is False  # type: ignore[index]
    assert plain.model_extra["metrics"]["drafted"] == 0  # type: ignore[index]


def test_newer_models_languages_and_keywords(client: OpenAI, benchdata: Path) -> None:
    """gpt-transcribe's `languages[]` (one: the language) and `keywords[]` (they follow the prompt), as the Agents
    SDK sends them through the official SDK's `extra_body`, give what `language` and `prompt` give; OpenAI's model
    names resolve to the served model."""
    german = (benchdata / "audio/fleurs/fleurs-de-001.wav").read_bytes()
    hinted = client.audio.transcriptions.create(
        model="gpt-transcribe", file=("de.wav", german), extra_body={"languages": ["de"], "keywords": ["Berlin"]}
    )
    plain = client.audio.transcriptions.create(
        model="whisper-1", file=("de.wav", german), language="de", prompt="Berlin"
    )
    assert hinted.text == plain.text and hinted.text


def test_errors_use_openai_shape(server: ServerProcess, jfk: bytes) -> None:
    url = f"{server.url}/v1/audio/transcriptions"
    cases = [
        ({"model": "whisper-9"}, {"file": ("a.wav", jfk)}, 404, "model_not_found"),
        ({"model": "gpt-4o-transcribe-diarize"}, {"file": ("a.wav", jfk)}, 404, "model_not_found"),  # names speakers
        ({"model": "whisper-1"}, None, 400, None),
        ({"model": "whisper-1"}, {"file": ("a.wav", b"")}, 400, "empty_file"),
        ({"model": "whisper-1"}, {"file": ("a.wav", b"RIFF....WAVEfmt garbage")}, 400, "invalid_audio"),
        ({"model": "whisper-1"}, {"file": ("a.txt", b"hello", "text/plain")}, 415, "unsupported_media_type"),
        ({"model": "whisper-1", "temperature": "3"}, {"file": ("a.wav", jfk)}, 400, None),
        ({"model": "whisper-1", "response_format": "xml"}, {"file": ("a.wav", jfk)}, 400, None),
        ({"model": "whisper-1", "language": "xx"}, {"file": ("a.wav", jfk)}, 400, None),
        ({"model": "whisper-1", "temperature": "warm"}, {"file": ("a.wav", jfk)}, 400, None),
    ]
    for data, files, status, code in cases:
        r = httpx.post(url, data=data, files=files, timeout=120)
        assert r.status_code == status, (data, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if code:
            assert error["code"] == code
    # Fields the endpoint does not know are refused and named, as OpenAI does: through the official SDK's
    # extra_body, a misspelt option, and `language` on translations.
    client = openai_client(server)
    for create, extra in (
        (client.audio.transcriptions.create, {"temprature": "0.2"}),
        (client.audio.transcriptions.create, {"timestamp_granularities": "word"}),  # without the SDK's []
        (client.audio.translations.create, {"language": "en"}),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="whisper-1", file=("a.wav", jfk), extra_body=extra)
        (name,) = extra
        assert refused.value.body["param"] == name and name in refused.value.body["message"], refused.value.body
    # The server still serves after all that.
    ok = post(server, jfk, timeout=120)
    assert ok.status_code == 200 and ok.json()["text"].startswith(JFK_START)


def test_headers_health_models_metrics(server: ServerProcess, jfk: bytes) -> None:
    r = post(server, jfk, timeout=120, **{"X-Request-Id": "req-123"})
    assert r.headers["x-request-id"] == "req-123"
    assert re.search(
        r"queue;dur=[\d.]+, encode;dur=[\d.]+, decode;dur=[\d.]+, total;dur=[\d.]+", r.headers["server-timing"]
    )
    assert httpx.get(f"{server.url}/health/live").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/health/ready").json()
    assert ready["ready"] is True and ready["model"] == "whisper-base"
    engine = ready["engine"]  # what this replica runs (CPUs differ between machines)
    assert engine["model"] == "whisper-base" and engine["assistant"] == ready["assistant"]
    assert engine["dtype"] == engine["encoder_dtype"] == "float32" and engine["device"] == "cpu"
    assert engine["encoder_attention"] in ("onednn", "flash") and engine["threads"] >= 1
    assert engine["decoder_attention"] in ("invariant", "sdpa")
    assert isinstance(engine["batch_invariant"], bool)  # the worker's warm-up checked it
    if engine["decoder_attention"] == "invariant":
        assert engine["batch_invariant"] is True
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert ids == ["whisper-base", "whisper-1"]
    assert httpx.get(f"{server.url}/v1/models/whisper-2").status_code == 404
    metrics = scrape_metrics(server.url)
    for name in (
        "specwhisper_requests_total",
        "specwhisper_queue_seconds_bucket",
        "specwhisper_encode_seconds_count",
        "specwhisper_decode_seconds_sum",
        "specwhisper_request_seconds_count",
        "specwhisper_audio_seconds_total",
        "specwhisper_tokens_total",
        "specwhisper_draft_proposed_total",
        "specwhisper_draft_accepted_total",
        "specwhisper_batch_size_bucket",
        "specwhisper_queue_depth",
        "specwhisper_model_load_seconds",
    ):
        assert name in metrics, name
    assert sample_value(metrics, "specwhisper_worker_up") == 1.0
    assert sample_value(metrics, "specwhisper_requests_total", route="/v1/audio/transcriptions", status="200")
    [(info, one)] = metrics["specwhisper_engine_info"]
    assert one == 1.0 and info["dtype"] == "float32" and info["model"] == "whisper-base", info
    assert info["batch_invariant"] in ("true", "false"), info
    # The worker reports each batch's mode and the policy's cost estimates (this server always speculates).
    assert (sample_value(metrics, "specwhisper_batches_total", mode="speculative") or 0) >= 1
    cost = sample_value(metrics, "specwhisper_mode_cost_ms_per_pass", batch_size="1", mode="speculative")
    assert cost is not None and cost > 0, metrics


def _batch_counts(server: ServerProcess) -> tuple[float, float]:
    return metric(server, "specwhisper_batch_size_bucket", le="1.0"), metric(server, "specwhisper_batch_size_count")


def test_concurrent_requests_are_batched_and_correct(server: ServerProcess, benchdata: Path) -> None:
    clips = ["whisper/jfk.wav", "fleurs/fleurs-es-002.wav", "ljspeech/LJ001-0002.wav", "pocketsphinx/goforward.wav"] * 2
    payloads = [(benchdata / "audio" / c).read_bytes() for c in clips]

    def text(data: bytes) -> str:
        r = post(server, data)
        assert r.status_code == 200, r.text
        return str(r.json()["text"])

    sequential = [text(p) for p in payloads[:4]]
    singles_before, total_before = _batch_counts(server)
    with cf.ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(text, payloads))
    assert concurrent == sequential * 2
    singles_after, total_after = _batch_counts(server)
    batches = total_after - total_before
    assert batches < 8, "8 simultaneous requests should share batches"
    assert (total_after - singles_after) > (total_before - singles_before)  # a batch of size > 1 ran


def test_worker_killed_mid_request_fails_fast_then_recovers(server: ServerProcess, benchdata: Path) -> None:
    long_audio = (benchdata / "audio/fleurs/fleurs-de-009.wav").read_bytes()  # 43 s: two windows
    pid = httpx.get(f"{server.url}/health/ready").json()["worker_pid"]
    result: dict[str, object] = {}

    def upload() -> None:
        t = time.monotonic()
        r = post(server, long_audio)
        result.update(status=r.status_code, body=r.json(), at=time.monotonic(), started=t)

    thread = threading.Thread(target=upload)
    thread.start()
    time.sleep(1.5)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert result["status"] == 503, result
    # Fails fast instead of hanging until the 300-s client timeout (loose bound: shared, noisy machines).
    assert result["at"] - killed_at < 10.0  # type: ignore[operator]
    assert result["body"]["error"]["type"] == "server_error"  # type: ignore[index]
    server.wait_ready(180)
    ready = httpx.get(f"{server.url}/health/ready").json()
    assert ready["worker_pid"] != pid and ready["worker_restarts"] == 1
    ok = post(server, long_audio)
    assert ok.status_code == 200 and len(ok.json()["text"]) > 100


strict_server = server_fixture(
    {
        "SPECWHISPER_API_KEYS": '["sk-test-1", "sk-test-2"]',
        "SPECWHISPER_QUEUE_SIZE": "1",
        "SPECWHISPER_MAX_BATCH": "1",
        "SPECWHISPER_MAX_UPLOAD_BYTES": "1000000",
        "SPECWHISPER_MAX_AUDIO_SECONDS": "60",
    },
    name="strict",
)


def test_auth_limits_and_backpressure(strict_server: ServerProcess, jfk: bytes, benchdata: Path) -> None:
    url = f"{strict_server.url}/v1/audio/transcriptions"
    assert httpx.post(url, data={"model": "whisper-1"}, files={"file": ("a.wav", jfk)}).status_code == 401
    bad = httpx.post(
        url, data={"model": "whisper-1"}, files={"file": ("a.wav", jfk)}, headers={"Authorization": "Bearer sk-wrong"}
    )
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{strict_server.url}/health/ready").status_code == 200  # health stays open
    client = openai_client(strict_server, api_key="sk-test-2")
    assert client.audio.transcriptions.create(model="whisper-1", file=("a.wav", jfk)).text.startswith(JFK_START)
    auth = {"Authorization": "Bearer sk-test-1"}
    big = httpx.post(url, data={"model": "whisper-1"}, files={"file": ("a.wav", b"\0" * 1_200_000)}, headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
    import io

    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(16000 * 61, dtype=np.int16), 16000, format="FLAC")
    long = httpx.post(url, data={"model": "whisper-1"}, files={"file": ("a.flac", buf.getvalue())}, headers=auth)
    assert long.status_code == 400 and long.json()["error"]["code"] == "audio_too_long"

    with cf.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: post(strict_server, jfk, **auth), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1 and limited.json()["error"]["type"] == "rate_limit_error"


def test_sigterm_drains_in_flight_work(strict_server: ServerProcess, jfk: bytes) -> None:
    result: dict[str, object] = {}

    def upload() -> None:
        r = post(strict_server, jfk, Authorization="Bearer sk-test-1")
        result.update(status=r.status_code, text=r.json().get("text", ""))

    thread = threading.Thread(target=upload)
    thread.start()
    time.sleep(0.7)
    assert strict_server.stop() in GRACEFUL
    thread.join(60)
    assert result["status"] == 200 and str(result["text"]).startswith(JFK_START)
