"""A replica's Prometheus metrics, exported through Ray's metrics pipeline with the replica's tags.

Each Ray node serves its actors' metrics on its metrics export port; Serve tags every metric a replica records
with `application`, `deployment` and `replica`. The replica's own registry (the standalone server's metric
names) is read every `interval_s` and each sample set as a Ray gauge of the same name (Ray prefixes `ray_`):
a counter's total, a histogram's `_bucket` (with `le`), `_count` and `_sum`, so `rate()` and
`histogram_quantile()` work on them as on the standalone server's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry

log = logging.getLogger("specwhisper.cluster")


class RayMetricsExport:
    def __init__(self, registry: CollectorRegistry, interval_s: float = 2.0) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._task: asyncio.Task[None] | None = None

    def export(self) -> int:
        """Set every sample of the registry once; returns how many."""
        from ray.serve import metrics as serve_metrics

        count = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                keys = tuple(sorted(sample.labels))
                gauge = self._gauges.get((sample.name, keys))
                if gauge is None:
                    gauge = serve_metrics.Gauge(sample.name, description=family.documentation, tag_keys=keys or None)  # type: ignore[arg-type]
                    self._gauges[(sample.name, keys)] = gauge
                gauge.set(sample.value, tags=dict(sample.labels) or None)  # type: ignore[arg-type]
                count += 1
        return count

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="ray-metrics-export")

    async def _loop(self) -> None:
        while True:
            try:
                self.export()
            except Exception:  # the export must not stop for one bad sample
                log.exception("exporting the replica's metrics to Ray")
            await asyncio.sleep(self.interval_s)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
