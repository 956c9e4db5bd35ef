"""Reading a running server's Prometheus `/metrics` page (prometheus_client's own text parser)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.server.metrics import Samples, samples_by_name


def parse_metrics(text: str) -> Samples:
    """The samples of a `/metrics` page by sample name (`app.server.metrics.samples_by_name`)."""
    return samples_by_name(text_string_to_metric_families(text))


def scrape_metrics(url: str, timeout: float = 30) -> Samples:
    """The `/metrics` samples of the server at base URL `url`."""
    r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def sample_value(metrics: Samples, name: str, **labels: str) -> float | None:
    """The value of sample `name` with exactly these labels (none: the unlabelled sample); None if absent."""
    return next((value for have, value in metrics.get(name, []) if have == labels), None)
