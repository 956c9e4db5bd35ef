"""The real server (uvicorn + worker process) on a free loopback port for tests: one way to start it (a
context manager, and a fixture factory on it that the quick tier recognises), and reading its metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from openai import OpenAI

from app.tools.process import ServerProcess, free_port
from app.tools.scrape import sample_value, scrape_metrics

__all__ = [
    "ServerProcess",
    "free_port",
    "metric",
    "openai_client",
    "post",
    "running",
    "running_server",
    "server_fixture",
    "starts_server",
]

STARTS_SERVER = "starts_server"  # the attribute that flags a fixture function as starting a server
F = TypeVar("F", bound=Callable[..., Any])


def starts_server(func: F) -> F:
    """Flag a hand-written fixture function that starts servers (tests using it leave the quick tier)."""
    setattr(func, STARTS_SERVER, True)
    return func


@contextlib.contextmanager
def running(
    *servers: ServerProcess,
    ready: bool = True,
    expect_exit: tuple[int, ...] | None = None,
    clean_log: bool = False,
) -> Iterator[None]:
    """Servers launched together (their models load at once), stopped (SIGTERM, a graceful drain) on leaving.

    ready: wait until each is ready (False: just launched). Checked once they have stopped, unless the body
    raised: expect_exit, each exit status is one of these; clean_log, each log holds no traceback.
    """
    codes: list[int | None] = [None] * len(servers)
    try:
        for srv in servers:
            srv.launch()
        if ready:
            for srv in servers:
                srv.wait_ready()
        yield
    finally:
        for i, srv in enumerate(servers):
            if srv.proc is not None:
                codes[i] = srv.stop()
    for srv, code in zip(servers, codes, strict=True):
        if expect_exit is not None:
            assert code in expect_exit, f"the server exited with {code} (log: {srv.log_path})"
        if clean_log:
            assert srv.log_path is not None
            text = srv.log_path.read_text(errors="replace")
            assert "Traceback" not in text, text[text.index("Traceback") - 500 : text.index("Traceback") + 3000]


@contextlib.contextmanager
def running_server(
    env: dict[str, str] | None = None,
    log: Path | None = None,
    *,
    own_group: bool = False,
    ready: bool = True,
    expect_exit: tuple[int, ...] | None = None,
    clean_log: bool = False,
) -> Iterator[ServerProcess]:
    """One server with settings `env` logging to `log` (`running`)."""
    srv = ServerProcess(env, log=log, own_group=own_group)
    with running(srv, ready=ready, expect_exit=expect_exit, clean_log=clean_log):
        yield srv


def server_fixture(
    env: dict[str, str] | Callable[[pytest.TempPathFactory], dict[str, str]] | None = None,
    *,
    scope: Any = "module",
    name: str = "server",
    own_group: bool = False,
    expect_exit: tuple[int, ...] | None = None,
    clean_log: bool = False,
) -> Any:
    """A pytest fixture of one ready server (`running_server`), its log in a temporary folder named `name`.

    env: the settings, or a function of pytest's `tmp_path_factory` that makes them (for folders of its own).
    Tests that use the fixture, directly or through other fixtures, are never in the quick tier.
    """

    @starts_server
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        settings = env(tmp_path_factory) if callable(env) else env
        log = tmp_path_factory.mktemp(name) / "server.log"
        with running_server(settings, log, own_group=own_group, expect_exit=expect_exit, clean_log=clean_log) as srv:
            yield srv

    return pytest.fixture(scope=scope)(fixture)


def post(server: ServerProcess, audio: bytes, *, timeout: float = 300, **headers: str) -> httpx.Response:
    """An upload of `audio` ("a.wav") for transcription by "whisper-1", with these request headers."""
    return httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": ("a.wav", audio)},
        headers=headers,
        timeout=timeout,
    )


def openai_client(server: ServerProcess, api_key: str = "unused") -> OpenAI:
    """The OpenAI client on the server's /v1, without retries."""
    return OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=300)


def metric(server: ServerProcess, name: str, default: float | None = None, **labels: str) -> float:
    """The value of sample `name` with exactly `labels` (none: the unlabelled one) on /metrics; `default`
    when absent (None: absence fails the test)."""
    value = sample_value(scrape_metrics(server.url), name, **labels)
    if value is None:
        assert default is not None, f"{name}{labels or ''} is not on /metrics"
        return default
    return value
