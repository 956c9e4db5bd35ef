"""What each process of a real server imports while it serves: the web process runs the VAD, clusters speakers and
answers every format without torch, transformers, the silero-vad package or scipy (each would cost it memory for
nothing: #46, #47); the worker runs the models and the speaker encoder with torch but without transformers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.clients import encode, realtime_text
from tests.server import ServerProcess, running_server, starts_server

WATCHED = ("torch", "transformers", "silero_vad", "scipy")

# Loaded first in every Python process started with the folder on PYTHONPATH (the web process and the worker it
# spawns): it writes "<pid> <package>" once for each watched package the process imports, as it does.
SITECUSTOMIZE = """
import os, sys

_WATCHED = {watched!r}
_seen = set()


def _hook(event, args):
    if event == "import":
        top = str(args[0]).split(".")[0]
        if top in _WATCHED and top not in _seen:
            _seen.add(top)
            with open({log!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{top}}\\n")


sys.addaudithook(_hook)
"""


@pytest.fixture(scope="module")
@starts_server
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("imports")
    log = folder / "imports.log"
    log.touch()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(watched=WATCHED, log=str(log)))
    with running_server({"PYTHONPATH": str(folder)}, folder / "server.log", clean_log=True) as srv:
        yield srv, log


def _imports(log: Path, pid: int) -> set[str]:
    return {line.split()[1] for line in log.read_text().splitlines() if int(line.split()[0]) == pid}


def test_the_web_process_serves_without_torch_and_the_worker_without_transformers(
    watched: tuple[ServerProcess, Path], clip: Callable[[str], np.ndarray]
) -> None:
    srv, log = watched
    speech = np.concatenate([clip("ljspeech/LJ001-0001"), np.zeros(16000, np.float32)])
    wav = encode(np.concatenate([speech, speech]), "wav")
    form = {"model": "whisper-1", "response_format": "verbose_json", "chunking_strategy": "auto", "diarize": "true"}
    r = httpx.post(f"{srv.url}/v1/audio/transcriptions", data=form, files={"file": wav}, timeout=300)
    assert r.status_code == 200 and r.json()["language"] == "english" and len(r.json()["segments"]) >= 2, r.text
    assert {s["speaker"] for s in r.json()["segments"]} == {"A"}  # diarized: prints in the worker, clusters here
    form = {"model": "whisper-1", "include[]": "logprobs"}
    r = httpx.post(f"{srv.url}/v1/audio/transcriptions", data=form, files={"file": wav}, timeout=300)
    assert r.status_code == 200 and r.json()["logprobs"][0]["bytes"], r.text
    assert "printing" in realtime_text(srv.url, speech).lower()

    worker = int(httpx.get(f"{srv.url}/health/ready").json()["worker_pid"])
    assert srv.proc is not None
    assert _imports(log, srv.proc.pid) == set()
    assert _imports(log, worker) == {"torch"}  # the hook sees the worker's imports: it runs the models with torch
