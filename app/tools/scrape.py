"""Reading a running server's Prometheus `/metrics` page (prometheus_client's own text parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[dict[str, str], float]  # (labels, value)
Metrics = dict[str, list[Sample]]


def parse_metrics(text: str) -> Metrics:
    """Samples by sample name (`specwhisper_requests_total`, `..._bucket`, `..._count`, gauges' own names).

    A metric on the page without samples yet (labelled, and no label set used so far) is there with none,
    under the name its HELP line gives (counters with `_total`).
    """
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        if not family.samples:
            out.setdefault(f"{family.name}_total" if family.type == "counter" else family.name, [])
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def scrape_metrics(url: str, timeout: float = 30) -> Metrics:
    """The `/metrics` samples of the server at base URL `url`."""
    import httpx  # a dev/test dependency: imported where used

    r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def sample_value(metrics: Metrics, name: str, **labels: str) -> float | None:
    """The value of sample `name` with exactly these labels (none: the unlabelled sample); None if absent."""
    return next((value for have, value in metrics.get(name, []) if have == labels), None)
