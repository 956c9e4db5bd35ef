"""The Ray Serve application: the standalone server's FastAPI app as the ingress, engine replicas behind it.

    serve run deploy/ray/serve.yaml                  # a config file (import_path: ...application:build)
    python -m app serve --ray auto                   # the CLI: an existing cluster (or `--ray local`)

The ingress is the same app (`create_app`) with the replicas' client as its engine: the routes, limits,
errors, realtime sessions and request metrics are the standalone server's. Each engine replica keeps the
main and assistant models resident in its worker process and batches its jobs (1..`max_batch`); Serve
scales replicas on their ongoing requests, with the target at `max_batch` per replica.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from app.server.app import create_app
from app.server.cluster.client import ServeEngineClient
from app.server.cluster.export import RayMetricsExport
from app.server.cluster.replica import EngineReplica
from app.server.metrics import ServerMetrics
from app.settings import Settings

APP_NAME = "specwhisper"
ENGINE = "EngineReplica"
INGRESS = "Ingress"


class ClusterOptions(BaseModel):
    """The application's arguments (`args:` of a Serve config file, or the CLI's flags)."""

    settings: dict[str, Any] = Field(
        default_factory=dict, description="Settings fields (as SPECWHISPER_* would set them); the rest from env"
    )
    min_replicas: int = Field(1, ge=1, description="engine replicas kept however idle")
    max_replicas: int = Field(4, ge=1, description="engine replicas at most")
    initial_replicas: int | None = Field(None, ge=1, description="replicas to start with (default: min_replicas)")
    replica_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves per engine replica")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs per engine replica (1 to give each its own)")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per engine replica (to place them on nodes so labelled)"
    )
    ingress_replicas: int = Field(
        2, ge=1, description="ingress (HTTP) replicas: Serve spreads them over nodes, so losing one leaves another"
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="sustained load this long adds a replica")
    downscale_delay_s: float = Field(120.0, ge=0, description="idleness this long removes one")
    look_back_period_s: float = Field(30.0, gt=10, description="the window load is averaged over (s)")


class Ingress:
    """The HTTP/WebSocket ingress: the app of `create_app`, its engine the replicas' handle."""

    async def __init__(self, engine: DeploymentHandle, settings: Settings) -> None:  # type: ignore[misc]  # Serve awaits it
        self.engine = engine
        self.settings = settings

    def __serve_build_asgi_app__(self) -> FastAPI:
        def client(settings: Settings, metrics: ServerMetrics) -> ServeEngineClient:
            # the ingress's request metrics go out through Ray's too, tagged with this replica
            export = RayMetricsExport(metrics.registry)
            return ServeEngineClient(self.engine, settings, replicas=_running_replicas, export=export)

        # Serve's proxy gives each request an X-Request-Id (the client's, if it sent one) and echoes it
        return create_app(self.settings, engine=client, preload=True, echo_request_id=False)


def _running_replicas() -> int:
    """Engine replicas Serve's controller reports running (a blocking call: run it in a thread)."""
    app_name = serve.get_replica_context().app_name
    status = serve.status().applications[app_name].deployments[ENGINE]
    return sum(count for state, count in status.replica_states.items() if state == "RUNNING")


def _replica_options(options: ClusterOptions, settings: Settings) -> dict[str, Any]:
    """An engine replica's Ray resources; with a worker memory budget, Ray reserves that memory for it, so that it
    places replicas only where their workers fit."""
    out: dict[str, Any] = {
        "num_cpus": options.replica_cpus,
        "num_gpus": options.replica_gpus,
        "resources": options.replica_resources,
    }
    if settings.worker_memory_mb is not None:
        out["memory"] = round(settings.worker_memory_mb * 2**20)
    return out


def build(args: dict[str, Any] | None = None) -> Application:
    """The application (Serve's builder: `serve run app.server.cluster.application:build key=value`)."""
    options = ClusterOptions(**(args or {}))
    settings = Settings(**options.settings)
    graceful = settings.shutdown_timeout_s + 5
    engine = serve.deployment(
        name=ENGINE,
        ray_actor_options=_replica_options(options, settings),
        # Serve sends a replica at most this many jobs; its own queue answers 429 beyond queue_size.
        max_ongoing_requests=settings.queue_size,
        max_queued_requests=settings.queue_size * max(1, options.max_replicas),
        autoscaling_config={
            "min_replicas": options.min_replicas,
            "initial_replicas": options.initial_replicas or options.min_replicas,
            "max_replicas": max(options.max_replicas, options.min_replicas),
            # a replica's batches stay at 1..max_batch: more ongoing jobs than that call for another replica
            "target_ongoing_requests": settings.max_batch,
            "upscale_delay_s": options.upscale_delay_s,
            "downscale_delay_s": options.downscale_delay_s,
            "look_back_period_s": options.look_back_period_s,
        },
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_wait_loop_s=1,
        graceful_shutdown_timeout_s=graceful,
    )(EngineReplica)
    ingress = serve.deployment(
        name=INGRESS,
        num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=max(100, settings.queue_size * 2),
        graceful_shutdown_timeout_s=graceful,
    )(serve.ingress()(Ingress))
    return ingress.bind(engine.bind(settings), settings)
