"""`python -m app peerbench`: SpecWhisper against real peer servers, each installed in its own environment.

The command sets up WhisperLive and faster-whisper-server (their environments and the CTranslate2 weights are
kept in the user's cache, so only the first run installs), starts every server, drives each with the same
uploads and live sessions, and writes its report. Each server must answer every request with the clip's
words: a peer that does not start, a protocol client that misreads a peer, or a report that leaves a server
or a level out fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.tools.peers.install import default_root
from tests.conftest import run_app

SERVERS = ("specwhisper", "whisperlive", "faster-whisper-server")
FIELDS = ("throughput_audio_s_per_s", "p50_ms", "p95_ms", "wer", "errors", "peak_rss_mb")


@pytest.mark.slow
@pytest.mark.server
def test_peerbench_drives_every_server_with_the_same_load(benchdata: Path, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "peers.json", tmp_path / "peers.png"
    # Two upload levels (the report across levels); one live level: WhisperLive's two-session level alone took ~45 s.
    args = ("--clients", "1,2", "--sessions", "1", "--clips", "2", "--requests", "4", "--live-clips", "1")
    done = run_app("peerbench", "--manifest", str(benchdata / "manifest.jsonl"), *args,
                   "--json", str(out_json), "--plot", str(out_png), timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out_json.read_text())
    servers = report["servers"]
    assert set(servers) == set(SERVERS)

    for name in SERVERS:
        server = servers[name]
        assert set(server["uploads"]) == {"1", "2"}, name
        for level in server["uploads"].values():
            assert all(level[field] is not None for field in FIELDS), (name, level)
            assert level["errors"] == 0 and level["requests"] == 4, (name, level)
            assert level["throughput_audio_s_per_s"] > 0 and level["p50_ms"] <= level["p95_ms"] <= level["p99_ms"]
            assert level["wer"] < 0.25, (name, level)  # every server transcribes the clips: the words come back
            assert 100 < level["peak_rss_mb"] < 8000, (name, level)  # a whole server with its model, measured
        assert server["setup"]["threads"] == 2 and server["setup"]["decoding"].startswith("greedy")

    # Live audio through each server's own protocol.
    assert servers["faster-whisper-server"]["live"] == {}  # it has no live protocol
    # Each server's live level is reported whole, and every utterance has its final, heard as well as uploaded:
    # for WhisperLive that shows that we read its protocol.
    for name in ("specwhisper", "whisperlive"):
        assert set(servers[name]["live"]) == {"1"}, name
        level = servers[name]["live"]["1"]
        assert level["utterances"] == level["sessions"] == 1, (name, level)
        assert level["missing_finals"] == 0 and level["errors"] == 0, (name, level)
        assert 0 < level["p50_ms"] <= level["p95_ms"] and level["wer"] < 0.3, (name, level)
        assert level["first_partial_p50_ms"] is not None, (name, level)
        assert all(level[field] is not None for field in FIELDS), (name, level)

    targets = report["targets"]
    for key in ("uploads_throughput_vs_best_peer_at_1", "uploads_throughput_vs_best_peer_at_2",
                "live_p95_final_vs_whisperlive_at_1"):  # fmt: skip
        assert targets[key]["ratio"] > 0, key
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| whisperlive | 2 |" in done.stdout  # the table

    # The peers live in their own environments: nothing of theirs reaches the project's.
    for peer, module in (("whisperlive", "whisper_live"), ("faster-whisper-server", "faster_whisper_server")):
        python = default_root() / peer / "venv" / "bin" / "python"
        theirs = subprocess.run(
            [python, "-c", f"import sys, {module}; print(sys.prefix)"], capture_output=True, text=True
        )
        assert theirs.returncode == 0 and Path(theirs.stdout.strip()) == default_root() / peer / "venv", theirs.stderr
        mine = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
        assert mine.returncode != 0, f"{module} is importable in the project's environment"
