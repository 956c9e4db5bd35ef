"""The Ray Serve config in the repo and the deployments `build` makes from it: parsed by Serve's own schema, and
sized from the settings as docs/deployment.md says (no cluster is started: tests/test_ray_serve.py runs one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ray.serve.schema import ServeDeploySchema

from app.server.cluster.application import APP_NAME, ENGINE, INGRESS, build
from app.settings import Settings

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "ray" / "serve.yaml"


def _deployments(args: dict[str, Any]) -> tuple[Any, Any, Settings]:
    ingress = build(args)._bound_deployment
    engine_app, settings = ingress.init_args
    return ingress, engine_app._bound_deployment, settings


def test_config_is_valid_and_sizes_the_replicas_from_the_settings() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    assert app.name == APP_NAME and app.route_prefix == "/"
    assert app.import_path == "app.server.cluster.application:build"
    ingress, engine, settings = _deployments(app.args)
    assert (ingress.name, engine.name) == (INGRESS, ENGINE)
    assert settings.threads == app.args["replica_cpus"] == engine.ray_actor_options["num_cpus"]
    scaling = engine._deployment_config.autoscaling_config
    # batches stay at 1..max_batch: a replica with more ongoing jobs than that calls for another
    assert scaling.target_ongoing_requests == settings.max_batch
    assert settings.worker_memory_mb is not None  # Ray places a replica only where its worker's budget fits
    assert engine.ray_actor_options["memory"] == settings.worker_memory_mb * 2**20
    assert (scaling.min_replicas, scaling.max_replicas) == (app.args["min_replicas"], app.args["max_replicas"])
    config_of = engine._deployment_config
    assert config_of.max_ongoing_requests == settings.queue_size  # beyond it the replica's own 429
    assert config_of.graceful_shutdown_timeout_s > settings.shutdown_timeout_s  # the replica drains first


def test_settings_and_placement_come_from_the_arguments() -> None:
    _, engine, settings = _deployments(
        {"settings": {"max_batch": 2, "queue_size": 8}, "replica_gpus": 1, "replica_resources": {"gpu_node": 1}}
    )
    assert (settings.max_batch, settings.queue_size) == (2, 8)
    assert engine._deployment_config.autoscaling_config.target_ongoing_requests == 2
    assert engine.ray_actor_options["num_gpus"] == 1 and engine.ray_actor_options["resources"] == {"gpu_node": 1}
