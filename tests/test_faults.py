"""Faults against the real server on loopback: worker death, slow clients, client disconnects, SIGTERM drain.

Only the issue's explicit bound is timed (an in-flight request fails within 1 s of the worker's death);
everything else is ordering and counting: which request finished while which one was still going,
what the server's counters say about work it dropped.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.sync.client import connect

from tests.server import ServerProcess, post, running_server, server_fixture
from tests.server import metric as server_metric

LONG_CLIP = "audio/fleurs/fleurs-de-009.wav"  # 43 s: two windows, several seconds of work
SHORT_CLIP = "audio/ljspeech/LJ001-0002.wav"  # "in being comparatively modern."
SHORT_TEXT = "in being comparatively modern."
GRACEFUL = (0, -signal.SIGTERM)

pytestmark = pytest.mark.server  # every test here starts a server (the module's, or one of its own)

server = server_fixture(
    {
        "SPECWHISPER_MAX_BATCH": "1",
        "SPECWHISPER_BATCH_WINDOW_MS": "0",
        "SPECWHISPER_MAX_QUEUED_AUDIO_SECONDS": "60",
        # a long upload runs as one batch here, as these tests count batches and queued audio
        # (tests/test_long_uploads.py: one window per batch, the default)
        "SPECWHISPER_WINDOWS_PER_TURN": "0",
    },
    name="faults",
    own_group=True,
)


@pytest.fixture(scope="module")
def long_audio(benchdata: Path) -> bytes:
    return (benchdata / LONG_CLIP).read_bytes()


@pytest.fixture(scope="module")
def short_audio(benchdata: Path) -> bytes:
    return (benchdata / SHORT_CLIP).read_bytes()


def metric(server: ServerProcess, name: str) -> float:
    return server_metric(server, name, default=0.0)


def wait_until(predicate: Any, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def multipart(audio: bytes, boundary: str = "specwhisper-boundary") -> tuple[bytes, str]:
    parts = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    return parts + audio + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def raw_request(server: ServerProcess, body: bytes, content_type: str) -> tuple[socket.socket, bytes]:
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=300)
    return sock, head


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_worker_death_fails_in_flight_and_queued_requests_within_a_second(
    server: ServerProcess, long_audio: bytes, short_audio: bytes
) -> None:
    pid = httpx.get(f"{server.url}/health/ready").json()["worker_pid"]
    batches = metric(server, "specwhisper_batch_size_count")
    results: dict[str, tuple[int, dict[str, Any], float]] = {}

    def send(name: str, audio: bytes) -> None:
        r = post(server, audio)
        results[name] = (r.status_code, r.json(), time.monotonic())

    running = threading.Thread(target=send, args=("running", long_audio))
    running.start()
    wait_until(lambda: metric(server, "specwhisper_batch_size_count") > batches, what="the batch to start")
    queued = threading.Thread(target=send, args=("queued", short_audio))
    queued.start()
    wait_until(lambda: metric(server, "specwhisper_queue_depth") >= 1, what="the second request to queue")
    time.sleep(1.0)  # the worker is well into the long clip
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    running.join(60)
    queued.join(60)
    for name in ("running", "queued"):
        status, body, at = results[name]
        assert status == 503, (name, body)
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "not_ready"
        print(f"{name}: 503 {at - killed_at:.3f} s after the kill")
        assert at - killed_at < 1.0, f"{name} answered {at - killed_at:.2f} s after the worker died"
    server.wait_ready(180)
    ready = httpx.get(f"{server.url}/health/ready").json()
    assert ready["worker_pid"] != pid and ready["worker_restarts"] >= 1
    ok = post(server, short_audio)
    assert ok.status_code == 200 and ok.json()["text"] == SHORT_TEXT


def test_a_worker_that_dies_while_loading_is_restarted_after_a_pause(server: ServerProcess) -> None:
    """The first death after a batch is answered by a restart at once; a second one without a batch in
    between (here while the new worker loads) waits 1 s, then 2, 4 ...: a crash loop does not spin."""
    assert server.log_path is not None

    def worker_pid() -> int:
        return int(httpx.get(f"{server.url}/health/ready").json()["worker_pid"])

    serving = worker_pid()
    os.kill(serving, signal.SIGKILL)
    wait_until(lambda: worker_pid() != serving, what="a new worker")
    loading = worker_pid()
    assert httpx.get(f"{server.url}/health/ready").status_code == 503  # still loading its models
    os.kill(loading, signal.SIGKILL)
    wait_until(lambda: worker_pid() not in (serving, loading), what="the second restart")
    server.wait_ready(180)
    log = server.log_path.read_text()
    assert log.count("restarting in 0 s") >= 1 and log.count("restarting in 1 s") == 1, log[-2000:]
    assert httpx.get(f"{server.url}/health/ready").json()["worker_restarts"] >= 2


def test_a_model_that_cannot_load_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    """Settings that name no usable model: one worker tries, and the server exits with status 1 and
    the reason, instead of restarting the worker forever behind a 503."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    log = tmp_path / "server.log"
    with running_server({"SPECWHISPER_MODEL": str(empty)}, log, ready=False) as srv:
        assert srv.proc is not None
        code = srv.proc.wait(timeout=120)
    text = log.read_text()
    assert code == 1, text[-2000:]
    assert text.count("so it is not restarted") == 1 and "restarting" not in text, text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: the server stopped:") and "neither a Hugging Face nor a CTranslate2" in last


def test_a_hung_worker_is_killed_and_replaced(long_audio: bytes, short_audio: bytes, tmp_path: Path) -> None:
    """A worker that stops (SIGSTOP) in the middle of a batch sends no heartbeat: after the stall
    timeout the supervisor kills it, the batch's request gets 503, and a new worker serves."""
    env = {"SPECWHISPER_MAX_BATCH": "1", "SPECWHISPER_WORKER_STALL_TIMEOUT_S": "6"}
    with running_server(env, tmp_path / "server.log") as srv:
        hung = httpx.get(f"{srv.url}/health/ready").json()["worker_pid"]
        try:
            assert post(srv, short_audio).status_code == 200
            answer: list[httpx.Response] = []
            upload = threading.Thread(target=lambda: answer.append(post(srv, long_audio)))
            upload.start()
            wait_until(lambda: metric(srv, "specwhisper_batch_size_count") >= 2, what="the long batch to start")
            os.kill(hung, signal.SIGSTOP)
            upload.join(120)
            assert answer and answer[0].status_code == 503, answer and answer[0].text
            assert "killing it as hung" in (tmp_path / "server.log").read_text()
            srv.wait_ready(180)
            assert httpx.get(f"{srv.url}/health/ready").json()["worker_pid"] != hung
            assert post(srv, short_audio).json()["text"] == SHORT_TEXT
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)


def test_a_worker_that_never_gets_ready_is_restarted(tmp_path: Path) -> None:
    """Models that take longer to load than allowed (here 1 s): the worker is killed and started again."""
    log = tmp_path / "server.log"
    with running_server({"SPECWHISPER_WORKER_START_TIMEOUT_S": "1"}, log, ready=False) as srv:
        wait_until(lambda: log.read_text().count("not ready after") >= 2, timeout=60, what="two restarts")
        assert httpx.get(f"{srv.url}/health/ready").status_code == 503


def test_slow_upload_does_not_block_other_requests(server: ServerProcess, short_audio: bytes) -> None:
    body, content_type = multipart(short_audio)
    sock, head = raw_request(server, body, content_type)
    sock.sendall(head + body[:1000])
    finished = threading.Event()

    def trickle() -> None:  # 2 kB at a time, holding the last bytes until the fast client is done (bounded)
        sent = 1000
        deadline = time.monotonic() + 120
        while not finished.is_set() and time.monotonic() < deadline:
            if sent < len(body) - 10:
                sock.sendall(body[sent : min(sent + 2000, len(body) - 10)])
                sent = min(sent + 2000, len(body) - 10)
            time.sleep(0.1)
        sock.sendall(body[sent:])

    slow = threading.Thread(target=trickle)
    slow.start()
    fast = post(server, short_audio)
    assert slow.is_alive(), "the slow upload should still be trickling while the fast request completes"
    finished.set()
    assert fast.status_code == 200 and fast.json()["text"] == SHORT_TEXT
    slow.join(120)
    status, answer = read_response(sock)
    sock.close()
    assert status == 200 and json.loads(answer)["text"] == SHORT_TEXT


def test_websocket_client_that_stops_reading_is_disconnected(server: ServerProcess, short_audio: bytes) -> None:
    """A client floods events that each cause an error event, and never reads: the server's send buffers fill,
    its per-session outbound queue fills, and it drops the session instead of buffering without bound."""
    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    with connect(url, sock=sock, max_size=None) as ws:
        sessions = metric(server, "specwhisper_realtime_sessions")
        assert sessions >= 1
        sent = 0
        flood = json.dumps({"type": "x" * 400})  # each answered by an error event of ~600 bytes
        try:
            while sent < 60_000:
                ws.send(flood)
                sent += 1
                if sent % 2000 == 0 and metric(server, "specwhisper_realtime_sessions") < sessions:
                    break
        except Exception:  # the server closed the connection under us
            pass
        wait_until(lambda: metric(server, "specwhisper_realtime_sessions") < sessions, 60, "the session to drop")
        # Others are served meanwhile, and the reader that never read gets a bounded stream, then the end.
        ok = post(server, short_audio)
        assert ok.status_code == 200 and ok.json()["text"] == SHORT_TEXT
        received = 0
        with pytest.raises(Exception):  # noqa: B017 - ConnectionClosed or a reset, either way it is closed
            while True:
                ws.recv(timeout=30)
                received += 1
        assert received < sent


def test_client_disconnect_cancels_its_queued_work(
    server: ServerProcess, long_audio: bytes, short_audio: bytes
) -> None:
    batches = metric(server, "specwhisper_batch_size_count")
    cancelled = metric(server, "specwhisper_requests_cancelled_total")
    dropped = metric(server, "specwhisper_queue_dropped_total")
    result: dict[str, httpx.Response] = {}
    running = threading.Thread(target=lambda: result.update(r=post(server, long_audio)))
    running.start()
    wait_until(lambda: metric(server, "specwhisper_batch_size_count") > batches, what="the long batch to start")
    body, content_type = multipart(short_audio)
    sock, head = raw_request(server, body, content_type)
    sock.sendall(head + body)
    wait_until(lambda: metric(server, "specwhisper_queue_depth") >= 1, what="the request to queue")
    sock.close()  # the client goes away while its request waits
    wait_until(lambda: metric(server, "specwhisper_requests_cancelled_total") > cancelled, what="the cancellation")
    running.join(300)
    assert result["r"].status_code == 200
    wait_until(lambda: metric(server, "specwhisper_queue_dropped_total") > dropped, what="the queued work to drop")
    ok = post(server, short_audio)
    assert ok.status_code == 200 and ok.json()["text"] == SHORT_TEXT
    # Batches: the long one and the last one; the abandoned request never ran.
    assert metric(server, "specwhisper_batch_size_count") == batches + 2


def test_client_disconnect_stops_its_running_transcription(
    server: ServerProcess, long_audio: bytes, short_audio: bytes
) -> None:
    """A client that leaves a long transcription frees the worker at the next 30-s window, not at the end."""
    samples, rate = sf.read(io.BytesIO(long_audio), dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, np.concatenate([samples] * 4), rate, format="WAV")  # ~3 min: six or more windows
    batches = metric(server, "specwhisper_batch_size_count")
    stopped = metric(server, "specwhisper_running_cancelled_total")
    body, content_type = multipart(buf.getvalue())
    sock, head = raw_request(server, body, content_type)
    sock.sendall(head + body)
    wait_until(lambda: metric(server, "specwhisper_batch_size_count") > batches, what="the long batch to start")
    sock.close()
    # The counter moves only when the worker hands back a transcription it ended early.
    wait_until(lambda: metric(server, "specwhisper_running_cancelled_total") > stopped, what="the worker to stop")
    ok = post(server, short_audio)
    assert ok.status_code == 200 and ok.json()["text"] == SHORT_TEXT


def test_queued_audio_is_bounded_in_seconds(server: ServerProcess, long_audio: bytes, short_audio: bytes) -> None:
    """The queue holds decoded audio: with 60 s allowed, one 43-s file may wait, a second gets 429, a short one fits."""
    batches = metric(server, "specwhisper_batch_size_count")
    results: dict[str, httpx.Response] = {}

    def send(name: str, audio: bytes) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.update({name: post(server, audio)}))
        thread.start()
        return thread

    threads = [send("running", long_audio)]
    wait_until(lambda: metric(server, "specwhisper_batch_size_count") > batches, what="the first batch to start")
    threads.append(send("queued", long_audio))
    wait_until(lambda: metric(server, "specwhisper_queue_depth") >= 1, what="the second file to queue")
    refused = post(server, long_audio)
    threads.append(send("short", short_audio))
    for thread in threads:
        thread.join(300)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert int(refused.headers["retry-after"]) >= 1
    assert [results[k].status_code for k in ("running", "queued", "short")] == [200, 200, 200]
    assert results["short"].json()["text"] == SHORT_TEXT


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_worker_does_not_outlive_a_killed_server(long_audio: bytes, tmp_path: Path) -> None:
    """SIGKILL to the server's whole group while a 3-minute upload is being transcribed: the worker,
    in a session of its own, must go with the web process rather than finish the batch for no one."""
    samples, rate = sf.read(io.BytesIO(long_audio), dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, np.tile(samples, 4), rate, format="WAV")
    env = {"SPECWHISPER_MAX_BATCH": "1", "SPECWHISPER_BATCH_WINDOW_MS": "0"}
    with running_server(env, tmp_path / "server.log", own_group=True) as srv:
        assert srv.proc is not None
        worker = httpx.get(f"{srv.url}/health/ready").json()["worker_pid"]

        def upload() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
                post(srv, buf.getvalue())

        thread = threading.Thread(target=upload)
        thread.start()
        wait_until(lambda: metric(srv, "specwhisper_batch_size_count") >= 1, what="the batch to start")
        os.killpg(srv.proc.pid, signal.SIGKILL)
        wait_until(lambda: not _alive(worker), timeout=10, what="the worker to exit")
        thread.join(60)


def test_sigterm_drains_running_and_queued_requests(server: ServerProcess, short_audio: bytes) -> None:
    """Runs last: the server exits. One request running and two queued all finish; new ones are refused.

    The SIGTERM goes to the server's whole process group, as `timeout` or `kill -TERM -- -PGID` send
    it: the worker must not take it (it runs in its own session) while the web process drains.
    """
    batches = metric(server, "specwhisper_batch_size_count")
    results: list[tuple[int, str]] = []

    def send() -> None:
        r = post(server, short_audio)
        results.append((r.status_code, r.json().get("text", "")))

    threads = [threading.Thread(target=send) for _ in range(3)]
    threads[0].start()
    wait_until(lambda: metric(server, "specwhisper_batch_size_count") > batches, what="the first batch")
    for t in threads[1:]:
        t.start()
    wait_until(lambda: metric(server, "specwhisper_queue_depth") >= 2, what="two requests to queue")
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(300)
    assert results == [(200, SHORT_TEXT)] * 3
    assert server.proc.wait(120) in GRACEFUL
    with pytest.raises(httpx.ConnectError):
        post(server, short_audio)
