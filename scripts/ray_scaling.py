"""Throughput of SpecWhisper on Ray Serve with 1 and with 2 engine replicas, measured side by side in one run.

    .venv/bin/python scripts/ray_scaling.py [--clients 8] [--duration 60] [--threads 1]

Starts a local Ray cluster of two nodes (a head and a worker raylet, one engine replica's room each), deploys the
application with a fixed replica count (1, then 2), and runs `python -m app loadtest`'s load against Serve's
proxy: every answer checked against the text its clip got alone. Prints each run's report and the ratio.
On one machine the nodes share its cores: the ratio shows what a second replica adds *here*, bounded by
the cores (2 on the project's machines, where one replica with 1 thread leaves the other core to the web
and Ray processes); on separate nodes each replica brings its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = parser.parse_args()

    os.environ["PYTHONPATH"] = str(ROOT)
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from app.server.cluster.application import APP_NAME, build
    from app.tools.loadtest import load_clips, loadtest
    from app.tools.manifest import default_manifest
    from app.tools.process import free_port

    clips = load_clips(default_manifest(), 4)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"engine": 1}})
    cluster.add_node(num_cpus=2, resources={"engine": 1})
    ray.init(address=cluster.address)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    reports = {}
    try:
        for replicas in (1, 2):
            options = {"min_replicas": replicas, "max_replicas": replicas, "replica_resources": {"engine": 1}}
            serve.run(build({"settings": {"threads": args.threads}, **options}), name=APP_NAME, route_prefix="/")
            while httpx.get(f"{url}/health/ready", timeout=10).status_code != 200:
                time.sleep(1)
            reports[replicas] = asyncio.run(loadtest(url, clips, args.clients, args.duration))
            print(json.dumps({"replicas": replicas, **reports[replicas]}, indent=2), flush=True)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    one, two = (reports[n]["throughput_rps"] for n in (1, 2))
    print(
        json.dumps(
            {
                "throughput_rps": {"1": one, "2": two},
                "ratio_2_over_1": round(two / one, 2) if one else None,
                "p50_ms": {str(n): reports[n]["latency_ms_ok"]["p50"] for n in (1, 2)},
                "passed": all(r["passed"] for r in reports.values()),
            }
        )
    )
    return 0 if all(r["passed"] for r in reports.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
