"""The real server (uvicorn + worker process) on a free loopback port, and reading its metrics, for tests."""

from __future__ import annotations

import re

import httpx

from app.tools.process import ServerProcess, free_port

__all__ = ["ServerProcess", "free_port", "metric"]


def metric(server: ServerProcess, name: str, default: float | None = None) -> float:
    """The value of an unlabelled sample on /metrics; `default` when absent (None: absence fails the test)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if found is None:
        assert default is not None, f"{name} is not on /metrics"
        return default
    return float(found.group(1))
