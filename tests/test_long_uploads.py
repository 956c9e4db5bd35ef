"""Long audio in small files against a real server: an upload's cost to the web process is bounded, the audio in
flight is budgeted (a line, then 429), and short uploads are answered, right, while long ones are read.

The storm here is small (20-minute files, a budget of ~2 chunked uploads); `python -m app storm` runs the full
one (16 silent + 4 speech hour-long files) with the targets of docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from app.server.serving.admission import BACKGROUND_NICE
from tests.server import ServerProcess, server_fixture
from tests.server import metric as server_metric

pytestmark = pytest.mark.server

SHORT_CLIP = "audio/ljspeech/LJ001-0002.wav"
SHORT_TEXT = "in being comparatively modern."

# A chunked upload holds 4 x 30 s of chunks plus 3 x 65.5 s of blocks: 316.6 s; a budget of 700 s admits two at
# once and lets a line of two more wait.
server = server_fixture({"SPECWHISPER_MAX_AUDIO_IN_FLIGHT_S": "700"}, name="long-uploads")


@pytest.fixture(scope="module")
def silence() -> bytes:
    """20 minutes of digital silence: a 60-kB FLAC file, 77 MB as float32."""
    out = io.BytesIO()
    sf.write(out, np.zeros(20 * 60 * 16000, np.int16), 16000, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def _peak_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


async def _upload(client: httpx.AsyncClient, url: str, data: bytes, **fields: str) -> httpx.Response:
    files = {"file": ("a.flac", data, "audio/flac")}
    return await client.post(f"{url}/v1/audio/transcriptions", data={"model": "whisper-1", **fields}, files=files)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through /proc")
def test_a_long_silent_upload_costs_the_web_process_little(server: ServerProcess, silence: bytes) -> None:
    """20 minutes of silence (77 MB of float32 when decoded whole; the web process's peak rose by ~3x that when it
    was): its peak rises by less than 100 MB, and the answer is empty text lasting 1200 s."""
    assert server.proc is not None
    pid = server.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _peak_kb(pid)
    r = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "chunking_strategy": "auto", "response_format": "verbose_json"},
        files={"file": ("a.flac", silence, "audio/flac")},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "" and r.json()["duration"] == 1200.0
    assert _peak_kb(pid) - before < 100 * 1024


def test_a_storm_of_long_uploads_is_budgeted_and_short_ones_go_on(
    server: ServerProcess, silence: bytes, benchdata: Path
) -> None:
    """Six 20-minute uploads at once, a budget for two: two run, two wait in line, two get 429 in OpenAI's shape with
    Retry-After; /metrics shows the audio in flight and the line meanwhile. A short upload sent again and again
    throughout is answered each time, with its text."""
    short = (benchdata / SHORT_CLIP).read_bytes()

    async def main() -> tuple[list[httpx.Response], list[httpx.Response], tuple[float, float]]:
        async with httpx.AsyncClient(timeout=600) as client:
            storm = [asyncio.create_task(_upload(client, server.url, silence, chunking_strategy="auto"))]
            await asyncio.sleep(0.5)  # the first one is admitted first
            storm += [
                asyncio.create_task(_upload(client, server.url, silence, chunking_strategy="auto")) for _ in range(5)
            ]
            seen = (0.0, 0.0)
            shorts: list[httpx.Response] = []
            while not all(t.done() for t in storm):
                shorts.append(await _upload(client, server.url, short))
                held = server_metric(server, "specwhisper_audio_in_flight_seconds", default=0.0)
                waiting = server_metric(server, "specwhisper_audio_budget_waiting", default=0.0)
                seen = (max(seen[0], held), max(seen[1], waiting))
            return [t.result() for t in storm], shorts, seen

    answers, shorts, (held, waiting) = asyncio.run(main())
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 200, 200, 200, 429, 429], [r.text[:200] for r in answers]
    for refused in (r for r in answers if r.status_code == 429):
        assert refused.json()["error"]["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
    assert all(r.json()["text"] == "" for r in answers if r.status_code == 200)
    assert held > 600 and waiting >= 1
    assert shorts and all(r.status_code == 200 and r.json()["text"] == SHORT_TEXT for r in shorts)
    assert server_metric(server, "specwhisper_audio_budget_refused_total", default=0.0) == 2
    assert server_metric(server, "specwhisper_audio_in_flight_seconds", default=-1.0) == 0


def test_a_short_upload_joins_the_batches_of_a_long_single_block_one(server: ServerProcess, benchdata: Path) -> None:
    """A 3-minute upload decoded as one block (6 windows): a short upload sent once it runs is answered, right,
    while the long one still has windows to go (the worker keeps the long one's state between its batches), and the
    long one is answered in full."""
    speech, rate = sf.read(benchdata / "audio/fleurs/fleurs-de-009.wav", dtype="int16")
    out = io.BytesIO()
    sf.write(out, np.tile(speech, 4), rate, format="FLAC")
    short = (benchdata / SHORT_CLIP).read_bytes()
    batches = server_metric(server, "specwhisper_batch_size_count", default=0.0)

    async def main() -> tuple[httpx.Response, httpx.Response, bool]:
        async with httpx.AsyncClient(timeout=600) as client:
            long = asyncio.create_task(_upload(client, server.url, out.getvalue(), language="de"))
            while server_metric(server, "specwhisper_batch_size_count", default=0.0) <= batches:
                await asyncio.sleep(0.05)
            answered = await _upload(client, server.url, short)
            still_running = not long.done()
            return answered, await long, still_running

    short_answer, long_answer, still_running = asyncio.run(main())
    assert short_answer.status_code == 200 and short_answer.json()["text"] == SHORT_TEXT
    assert still_running, "the short upload waited for all of the long one"
    assert long_answer.status_code == 200, long_answer.text
    assert long_answer.json()["metrics"]["audio_seconds"] > 170
    assert len(long_answer.json()["text"]) > 1000


def test_a_short_upload_runs_inside_a_batch_of_chunks_which_then_goes_on_unchanged(
    server: ServerProcess, benchdata: Path
) -> None:
    """A 3-minute chunked upload runs its first batch of chunks; a short upload sent then runs inside that batch in
    the worker (at its next encoder layer or decoder pass), right, and nothing is stopped; the long upload's answer is
    the same, word for word, as when it ran alone."""
    speech, rate = sf.read(benchdata / "audio/fleurs/fleurs-de-009.wav", dtype="int16")
    out = io.BytesIO()
    sf.write(out, np.tile(speech, 4), rate, format="FLAC")
    fields = {"language": "de", "chunking_strategy": "auto"}
    alone = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", **fields},
        files={"file": ("a.flac", out.getvalue())},
        timeout=300,
    )
    assert alone.status_code == 200, alone.text
    batches = server_metric(server, "specwhisper_batch_size_count", default=0.0)
    preempted = server_metric(server, "specwhisper_long_upload_jobs_preempted_total", default=0.0)
    inner = server_metric(server, "specwhisper_inner_batches_total", default=0.0)

    async def main() -> tuple[httpx.Response, httpx.Response, bool]:
        async with httpx.AsyncClient(timeout=600) as client:
            long = asyncio.create_task(_upload(client, server.url, out.getvalue(), **fields))
            while server_metric(server, "specwhisper_batch_size_count", default=0.0) <= batches:
                await asyncio.sleep(0.02)
            answered = await _upload(client, server.url, (benchdata / SHORT_CLIP).read_bytes())
            return answered, await long, long.done()

    short_answer, long_answer, _ = asyncio.run(main())
    assert short_answer.status_code == 200 and short_answer.json()["text"] == SHORT_TEXT
    assert server_metric(server, "specwhisper_inner_batches_total", default=0.0) > inner
    assert server_metric(server, "specwhisper_long_upload_jobs_preempted_total", default=0.0) == preempted
    assert long_answer.status_code == 200, long_answer.text
    assert long_answer.json()["text"] == alone.json()["text"] and len(alone.json()["text"]) > 1000


def _nice(stat: Path) -> int:
    return int(stat.read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads threads through /proc")
def test_upload_threads_give_the_cores_to_the_worker(server: ServerProcess, silence: bytes) -> None:
    """The steps of uploads past their first `PROMPT_S` run on threads of lower priority than the web process's others
    (`test_admission.py`: its first ones on a thread at the process's priority), and the worker shares the web
    process's session (where the kernel shares the CPU out by session, a session of its own split the cores evenly
    between the two processes: on 2 cores the worker's two threads then shared one, and a short upload took 13 s in
    place of 0.2), with a process group of its own (signals to the server's group reach the web process alone)."""
    assert server.proc is not None
    web = server.proc.pid
    r = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "chunking_strategy": "auto"},
        files={"file": ("a.flac", silence, "audio/flac")},
        timeout=300,
    )
    assert r.status_code == 200  # read on the upload threads of all tiers: its VAD takes a few seconds of CPU
    main = _nice(Path(f"/proc/{web}/stat"))
    nices = {_nice(stat) for stat in Path(f"/proc/{web}/task").glob("*/stat")}
    assert nices == {main, min(main + BACKGROUND_NICE, 19)}, nices  # no thread at a third priority
    worker = int(httpx.get(f"{server.url}/health/ready").json()["worker_pid"])
    assert os.getsid(worker) == os.getsid(web) and os.getpgid(worker) != os.getpgid(web)


def test_a_client_leaving_a_long_single_block_upload_frees_the_worker(server: ServerProcess, benchdata: Path) -> None:
    """A client that leaves a 3-minute single-block upload while it runs a window at a time: its transcription is
    dropped (stopped mid-window, or its state let go in the worker between its batches), and the next upload is
    answered at once, right."""
    speech, rate = sf.read(benchdata / "audio/fleurs/fleurs-de-009.wav", dtype="int16")
    out = io.BytesIO()
    sf.write(out, np.tile(speech, 4), rate, format="FLAC")
    batches = server_metric(server, "specwhisper_batch_size_count", default=0.0)
    ended = [
        server_metric(server, name, default=0.0)
        for name in ("specwhisper_running_cancelled_total", "specwhisper_queue_dropped_total")
    ]

    async def leave() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            long = asyncio.create_task(_upload(client, server.url, out.getvalue(), language="de"))
            while server_metric(server, "specwhisper_batch_size_count", default=0.0) <= batches + 1:
                await asyncio.sleep(0.05)  # its second window has begun
            long.cancel()

    asyncio.run(leave())
    r = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": ("a.wav", (benchdata / SHORT_CLIP).read_bytes())},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["text"] == SHORT_TEXT
    for _ in range(600):
        now = [
            server_metric(server, name, default=0.0)
            for name in ("specwhisper_running_cancelled_total", "specwhisper_queue_dropped_total")
        ]
        if now != ended:
            break
        time.sleep(0.1)
    assert now != ended, "the worker went on with a transcription nobody waits for"
    windows = server_metric(server, "specwhisper_batch_size_count", default=0.0) - batches
    assert windows < 6  # the long one's six windows (and the short one's) did not all run


def test_a_streaming_client_that_leaves_gives_its_place_back(server: ServerProcess, silence: bytes) -> None:
    """A client streaming a long upload's events (SSE) that leaves once the answer has begun: the upload's place in
    the audio budget goes back (else each such client would shrink the budget for good)."""
    with httpx.Client(timeout=300) as client:
        fields = {"model": "whisper-1", "chunking_strategy": "auto", "stream": "true"}
        files = {"file": ("a.flac", silence, "audio/flac")}
        with client.stream("POST", f"{server.url}/v1/audio/transcriptions", data=fields, files=files) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert server_metric(server, "specwhisper_audio_in_flight_seconds", default=0.0) > 0
    for _ in range(300):
        if server_metric(server, "specwhisper_audio_in_flight_seconds", default=-1.0) == 0:
            break
        time.sleep(0.1)
    assert server_metric(server, "specwhisper_audio_in_flight_seconds", default=-1.0) == 0


def test_the_storm_splits_a_short_answer_by_where_it_went(server: ServerProcess, benchdata: Path) -> None:
    """`python -m app storm` tells where a slow short upload waited from the answer's own metrics: the parts are
    each at least 0, the worker's are the encoder's and decoder's time, and together they are the client's latency."""
    from app.tools.storm import SPLIT_PARTS, Storm, slow_parts, where_it_waited

    short = (benchdata / SHORT_CLIP).read_bytes()
    answer = asyncio.run(Storm(server.url, short).upload(short, "short.wav"))
    assert answer.status == 200 and answer.text.strip() == SHORT_TEXT, answer
    split = where_it_waited(answer)
    assert tuple(split) == SPLIT_PARTS and all(v >= 0 for v in split.values()), split
    m = answer.metrics
    assert split["encoder"] == pytest.approx(m["encode_ms"] / 1000) and split["encoder"] > 0
    assert split["decoder"] == pytest.approx(m["decode_ms"] / 1000) and split["decoder"] > 0
    assert sum(split.values()) == pytest.approx(answer.seconds, abs=1e-6), (split, answer.seconds)
    summary = slow_parts([split, {**split, "queue": split["queue"] + 2.0}])
    assert summary["answers"] == 2 and summary["queue"]["max"] == pytest.approx(split["queue"] + 2.0, abs=0.01)


def test_the_storm_tells_the_short_answers_that_waited_for_a_live_final() -> None:
    """A short answer is counted beside a final when the final came while it was in flight (from its start to its
    end, both included), and each group's median and largest latency are its own answers'."""
    from app.tools.storm import beside_finals

    answers = [(10.0, 1.0), (12.0, 2.5), (20.0, 0.9), (30.0, 1.2), (31.0, 0.8)]  # (when it came, latency)
    split = beside_finals(answers, finals=[9.0, 11.0, 28.7, 31.0])
    assert split["with_final"] == {"answers": 3, "median": 1.0, "max": 2.5}, split  # 9.0 (its start), 11.0, 31.0
    assert split["without"] == {"answers": 2, "median": 1.05, "max": 1.2}, split  # 28.7 came before [28.8, 30.0]
    assert beside_finals(answers, finals=[])["with_final"] == {"answers": 0, "median": None, "max": None}
