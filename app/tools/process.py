"""`python -m app serve` as a child process on a free loopback port (for benchmarks, the soak, the storm and tests), and
the flags and verdict of the tools that run against one."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

# Set (to a reason) where no server may be started: the quick test tier sets it for its tests, and the
# commands and child processes they run inherit it.
FORBID_START = "SPECWHISPER_FORBID_SERVER_START"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_may_start() -> None:
    """Raise where no server may be started (`FORBID_START` set)."""
    if forbidden := os.environ.get(FORBID_START):
        raise RuntimeError(f"no server may be started here ({FORBID_START}={forbidden}): mark the test `server`")


def wait_until_ready(
    proc: subprocess.Popen[bytes] | None, url: str, timeout: float, what: str, log: Path | None
) -> None:
    """Until `url` answers 200; raises if `proc` exits or the time runs out (`what`: the server, in messages)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up (log: {log})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f} s (log: {log})")


class ServerProcess:
    """A server child process; `env` adds settings (SPECWHISPER_*), `log` receives its output.

    own_group: start it in a new session, as the leader of its own process group (`proc.pid` is the
    group's id), so that the whole group can be signalled as a shell or a service manager would.
    """

    def __init__(
        self,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        *,
        own_group: bool = False,
        args: Sequence[str] = (),
    ) -> None:
        self.own_group = own_group
        self.args = tuple(args)  # more flags of `serve`
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path = log
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it (several servers can load their models at once)."""
        ensure_may_start()
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child's
        cmd = [sys.executable, "-m", "app", "serve", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=out, start_new_session=self.own_group)
        return self

    def start(self, timeout: float = 300) -> ServerProcess:
        self.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 300) -> None:
        """Until /health/ready answers 200; raises if the process exits or the time runs out."""
        wait_until_ready(self.proc, f"{self.url}/health/ready", timeout, "the server", self.log_path)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful drain), SIGKILL after `timeout`; returns the exit status.

        A stopped process (SIGSTOP) is continued after the SIGTERM, to act on it.
        """
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def add_server_arguments(parser: argparse.ArgumentParser, pid_use: str) -> None:
    """The flags of a tool that starts its own server or takes a running one (`pid_use`: what its pid is read for),
    and `--json` for its report."""
    parser.add_argument("--url", help="a running server (default: start one on a free loopback port)")
    parser.add_argument("--server-pid", type=int, help=f"its web process id ({pid_use})")
    parser.add_argument("--log", type=Path, help="server log file (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the report here")


def print_verdict(report: dict[str, Any], path: Path | None) -> int:
    """Print a run's JSON report (and write it to `path`); the exit status: 0 when it `passed`."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        path.write_text(text)
    return 0 if report["passed"] else 1
