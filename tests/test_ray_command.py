"""`python -m app serve --ray local`, the documented one-command start on Ray: it starts a Ray cluster here,
deploys the application, answers the API through Serve's proxy, and on SIGTERM deletes it and exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.tools.manifest import ManifestClip
from tests.clients import check_text, encode, transcribe
from tests.server import ServerProcess, running

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_serve_on_a_local_ray_cluster(tmp_path: Path, manifest: dict[str, ManifestClip]) -> None:
    from app.api.audio import load_audio

    args = ("--ray", "local", "--threads", "1", "--max-replicas", "1")
    server = ServerProcess(log=tmp_path / "serve-ray.log", args=args)
    with running(server, expect_exit=(0,)):
        r = transcribe(server.url, *encode(load_audio(manifest["whisper/jfk"].audio), "wav"))
        assert r.status_code == 200, r.text
        check_text(manifest, "whisper/jfk", r.json()["text"])
        assert r.json()["metrics"]["tokens"] > 0
    log = (tmp_path / "serve-ray.log").read_text(errors="replace")
    assert "served by Ray" in log
