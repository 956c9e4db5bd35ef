"""The worker's memory budget (`SPECWHISPER_WORKER_MEMORY_MB`) on a real server: batches hold the clips it allows
and the worker stays within it; a budget too small for one clip stops the server with the reason. Readiness and
/metrics report the processes' memory."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.server.worker.budget import CLIP_MARGIN
from app.tools.manifest import ManifestClip
from tests.server import ServerProcess, metric, openai_client, running_server, server_fixture

BUDGET_MB = 1050  # Whisper base with its draft, 2 cores: ~550 MB idle, 119-152 MB a clip (x 1.2): batches of 2-3
MAX_BATCH = 4

pytestmark = pytest.mark.server

server = server_fixture({"SPECWHISPER_WORKER_MEMORY_MB": str(BUDGET_MB), "SPECWHISPER_MAX_BATCH": str(MAX_BATCH)})


def test_batches_hold_what_the_budget_allows_and_the_worker_stays_within_it(
    server: ServerProcess, manifest: dict[str, ManifestClip]
) -> None:
    ready = httpx.get(f"{server.url}/health/ready").json()
    memory = ready["memory"]
    assert ready["engine"]["batch_invariant"] is True  # checked once, after the budget's measuring warm-ups
    limit = memory["batch_limit"]
    assert memory["worker_budget_mb"] == BUDGET_MB and memory["web_mb"] > 0, memory
    clip = memory["clip_mb"] * CLIP_MARGIN
    assert limit == min(MAX_BATCH, math.floor((BUDGET_MB - memory["worker_idle_mb"]) / clip)), memory
    assert 1 <= limit < MAX_BATCH, f"the budget should bind on this machine: {memory}"
    assert memory["worker_idle_mb"] < memory["worker_mb"] + 50 < BUDGET_MB, memory
    assert metric(server, "specwhisper_batch_clips_limit") == limit
    assert metric(server, "specwhisper_worker_memory_budget_bytes") == BUDGET_MB * 2**20

    clips = [manifest[f"ljspeech/LJ001-{n:04d}"] for n in (1, 3, 4, 5)] * 2
    client = openai_client(server)

    def transcribe(entry: ManifestClip) -> str:
        with Path(entry.audio).open("rb") as f:
            return client.audio.transcriptions.create(model="whisper-1", file=f, language="en").text

    with ThreadPoolExecutor(len(clips)) as pool:
        texts = list(pool.map(transcribe, clips))
    assert texts[:4] == texts[4:] and all(len(t) > 20 for t in texts), texts

    batches = metric(server, "specwhisper_batch_size_count")
    within = metric(server, "specwhisper_batch_size_bucket", le=f"{float(limit)}")
    assert within == batches and batches >= len(clips) / limit, (within, batches)
    assert metric(server, "specwhisper_batch_size_bucket", le=f"{float(limit - 1)}", default=0) < batches
    peak = metric(server, "specwhisper_worker_batch_peak_memory_bytes")
    assert 0 < peak <= BUDGET_MB * 2**20, peak / 2**20
    assert metric(server, "specwhisper_worker_resident_memory_bytes") > 0


def test_a_budget_too_small_for_one_clip_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server({"SPECWHISPER_WORKER_MEMORY_MB": "300"}, log, ready=False) as srv:
        assert srv.proc is not None
        code = srv.proc.wait(timeout=180)
    text = log.read_text()
    assert code == 1, text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: the server stopped:") and "SPECWHISPER_WORKER_MEMORY_MB=300 is less than" in last
