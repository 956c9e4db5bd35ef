"""`python -m app serve --ray ADDRESS`: deploy the application on a Ray cluster and keep it until stopped."""

from __future__ import annotations

import signal
import threading
from typing import Any

from app.server.cluster.application import APP_NAME, build


def serve_on_ray(address: str, args: dict[str, Any], host: str, port: int) -> int:
    """Connect to the cluster at `address` ("auto": the one this machine belongs to; "local": start one here),
    run the application with `args` (see `ClusterOptions`) behind Serve's HTTP proxy on `host:port`, and
    delete it on SIGINT or SIGTERM (the replicas drain first). Returns the exit status."""
    import ray
    from ray import serve

    ray.init(address=None if address == "local" else address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(args), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"SpecWhisper is served by Ray at http://{host}:{port} (Ctrl+C deletes the application)", flush=True)
        stop.wait()
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0
