"""The load generator and the soak command against real servers (short runs; the long ones are commands)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.tools.loadtest import load_clips, loadtest
from tests.server import ServerProcess, server_fixture

small_queue_server = server_fixture({"SPECWHISPER_QUEUE_SIZE": "6", "SPECWHISPER_MAX_BATCH": "4"}, name="load")


def test_32_clients_get_correct_answers_or_429_with_retry_after(
    small_queue_server: ServerProcess, benchdata: Path
) -> None:
    clips = load_clips(benchdata / "manifest.jsonl", count=4)
    report = asyncio.run(loadtest(small_queue_server.url, clips, clients=32, duration_s=20))
    print(json.dumps(report, indent=2))
    assert report["ok"] >= 4 and report["rate_limited"] > 0, "the run should both serve and shed load"
    assert report["wrong_text"] == 0 and report["server_errors_5xx"] == 0 and report["unexpected_status"] == 0
    assert report["lost"] == 0 and report["duplicated"] == 0 and report["id_mismatch"] == 0
    assert report["rate_limited_without_retry_after"] == 0
    assert report["requests"] == sum(report["status_counts"].values())
    assert report["passed"]


@pytest.mark.slow
@pytest.mark.server  # the soak command starts its own
def test_soak_command_runs_and_passes_for_half_a_minute(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "app", "soak", "--minutes", "0.5", "--warmup-minutes", "0.2", "--interval", "10"]
    run = subprocess.run([*cmd, "--json", str(out), "--log", str(tmp_path / "server.log")], timeout=600)
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if k != "baseline"}, indent=2))
    assert report["uploads"] > 0 and report["live_utterances"] > 0
    assert set(report["checks"]) >= {"web_rss_growth", "worker_rss_growth", "web_fds", "asyncio_tasks", "no_5xx"}
    assert report["passed"], report["checks"]
    assert run.returncode == 0
