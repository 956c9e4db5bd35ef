"""Security properties against the real server: keys on REST and WebSocket, never logged; no temp files left."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.server.http.auth import authorized
from tests.server import ServerProcess, server_fixture

KEY = "sk-secret-7f3a9c1e5b2d"
WRONG = "sk-wrong-0d9e8c7b6a5f"


secured = server_fixture(
    lambda tmp_path_factory: {
        "SPECWHISPER_API_KEYS": json.dumps([KEY, "sk-other"]),
        "SPECWHISPER_LOG_LEVEL": "debug",  # the most talkative logs must not carry keys either
        "TMPDIR": str(tmp_path_factory.mktemp("server-tmp")),  # where uploads would be spooled
    },
    name="security",
)


def test_keys_required_everywhere_and_never_logged(secured: ServerProcess, benchdata: Path) -> None:
    server, tmp = secured, Path(secured.env["TMPDIR"])
    audio = (benchdata / "audio/ljspeech/LJ001-0002.wav").read_bytes()
    url = f"{server.url}/v1/audio/transcriptions"
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": KEY}, {"X-Api-Key": KEY}):
        r = httpx.post(url, data={"model": "whisper-1"}, files={"file": ("a.wav", audio)}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert KEY not in r.text and WRONG not in r.text
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models?api_key={KEY}").status_code == 401  # not a place for keys
    big = b"RIFF" + bytes(2_000_000)  # spooled to a temporary file while parsed
    ok = httpx.post(url, data={"model": "whisper-1"}, files={"file": ("a.wav", audio)},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=300)  # fmt: skip
    assert ok.status_code == 200
    bad = httpx.post(url, data={"model": "whisper-1"}, files={"file": ("../../../etc/passwd", big)},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=300)  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_audio"

    ws_url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    for kwargs in ({}, {"additional_headers": {"Authorization": f"Bearer {WRONG}"}},
                   {"subprotocols": ["realtime", f"openai-insecure-api-key.{WRONG}"]}):  # fmt: skip
        with connect(ws_url, **kwargs) as ws:  # type: ignore[arg-type]
            assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_api_key"
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=30)
    for kwargs in ({"additional_headers": {"Authorization": f"Bearer {KEY}"}},
                   {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}"]}):  # fmt: skip
        with connect(ws_url, **kwargs) as ws:  # type: ignore[arg-type]
            assert json.loads(ws.recv(timeout=30))["type"] == "session.created"

    left = [p for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own compile cache
    assert left == [], "uploads left temporary files behind"
    assert server.log_path is not None
    log = server.log_path.read_text(errors="replace")
    assert "POST /v1/audio/transcriptions" in log  # the access log is on ...
    assert KEY not in log and WRONG not in log  # ... and carries no key, right or wrong


def test_key_compare_is_exact() -> None:
    assert authorized("sk-a", ["sk-a", "sk-b"]) and authorized("sk-b", ["sk-a", "sk-b"])
    for token in ("", "sk-", "sk-a ", "SK-A", "sk-ab", "sk-a\x00"):
        assert not authorized(token, ["sk-a", "sk-b"]), token
    assert authorized("anything", [])  # no keys configured: open
