"""SpecWhisper on a real Ray cluster: a head node and a worker node (separate raylets, each with room for one
engine replica) on this machine, the application deployed by `app.server.cluster.application.build`, clients
through Serve's HTTP proxy. The tests run in order on one deployment: it starts with 2 replicas and may
scale between 1 and 2."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
from openai import OpenAI
from ray import serve
from ray.cluster_utils import Cluster

from app.api.audio import load_audio
from app.server.cluster.application import APP_NAME, ENGINE, INGRESS, build
from app.tools.manifest import ManifestClip
from app.tools.process import free_port
from app.tools.scrape import parse_metrics
from tests.clients import check_text, encode, realtime_text, sse_text, transcribe

pytestmark = [pytest.mark.slow, pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
CLIPS = ("whisper/jfk", "ljspeech/LJ001-0001", "ljspeech/LJ001-0002", "pocketsphinx/goforward")
SLOT = "specwhisper_engine"  # a custom resource: one engine replica fits on each node
REPLICA_PREFIX = f"SERVE_REPLICA::{APP_NAME}#{ENGINE}#"


ARGS = {
    "settings": {"threads": 1, "shutdown_timeout_s": 30},
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 2,
    "replica_resources": {SLOT: 1},
    "upscale_delay_s": 2,
    "downscale_delay_s": 10,
    "look_back_period_s": 12,
}


@dataclass
class RayCluster:
    cluster: Cluster
    worker: object  # the worker node (ray._private.node.Node)
    metrics_ports: dict[str, int]  # node id -> its metrics export port


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved) if p)  # the raylets' workers import app
    head_port, worker_port = free_port(), free_port()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {SLOT: 1},
            "include_dashboard": False,
            "metrics_export_port": head_port,
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    worker = c.add_node(num_cpus=2, resources={SLOT: 1}, metrics_export_port=worker_port)
    try:
        ray.init(address=c.address)
        ports = {c.head_node.node_id: head_port, worker.node_id: worker_port}
        yield RayCluster(c, worker, ports)
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def url(cluster: RayCluster) -> str:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build(ARGS), name=APP_NAME, route_prefix="/")
    address = f"http://127.0.0.1:{port}"
    # Serve calls the application ready once its replicas are constructed; an ingress is ready once it has heard
    # from an engine replica (its state is polled every second), as a load balancer's probe would wait for.
    deadline = time.monotonic() + 60
    while (status := httpx.get(f"{address}/health/ready", timeout=30).status_code) != 200:
        assert time.monotonic() < deadline, f"not ready a minute after Serve's start: {status}"
        time.sleep(0.5)
    return address


@pytest.fixture(scope="module")
def audio(manifest: dict[str, ManifestClip]) -> dict[str, np.ndarray]:
    return {clip: load_audio(manifest[clip].audio) for clip in CLIPS}


def running_replicas() -> int:
    states = serve.status().applications[APP_NAME].deployments[ENGINE].replica_states
    return sum(count for state, count in states.items() if state == "RUNNING")


def replica_names() -> set[str]:
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if a["name"].startswith(REPLICA_PREFIX)}


def kill_a_replica() -> str:
    """SIGKILL one live engine replica's actor (its worker process follows it); returns its name."""
    for name in sorted(replica_names()):
        try:
            actor = ray.get_actor(name, namespace="serve")
        except ValueError:  # it is going already
            continue
        ray.kill(actor, no_restart=True)
        return name
    raise AssertionError("no live engine replica to kill")


def wait_for(what: str, check: object, timeout: float) -> float:
    """Seconds until `check()` is true; fails after `timeout`."""
    started = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)
    return time.monotonic() - started


def by_replica(cluster: RayCluster, name: str, deployment: str, **labels: str) -> dict[str, dict[str, float]]:
    """Per node, a metric's value for each replica of `deployment` there (summed over other labels): the
    replicas' own metrics, exported by each node's Ray metrics agent with the replica's tags."""
    out: dict[str, dict[str, float]] = {}
    for node, port in cluster.metrics_ports.items():
        try:
            samples = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
        except httpx.HTTPError:
            continue  # a removed node
        replicas = out.setdefault(node, {})
        for tags, value in samples.get(f"ray_{name}", []):
            if tags.get("deployment") == deployment and all(tags.get(k) == v for k, v in labels.items()):
                replicas[tags["replica"]] = replicas.get(tags["replica"], 0.0) + value
    return out


class Seen:
    """The highest value each replica's counter was seen at (`read()`: node -> replica -> value), read every half
    second while in the `with` block: a replica that has stopped keeps its last reading."""

    def __init__(self, read: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.read = read
        self.most: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(0.5):
                return

    def sample(self) -> None:
        for node, replicas in self.read().items():
            seen = self.most.setdefault(node, {})
            for replica, value in replicas.items():
                seen[replica] = max(seen.get(replica, 0.0), value)

    def on_each(self, nodes: int) -> bool:
        """Some replica on each of `nodes` nodes reported a nonzero value."""
        return sum(any(v > 0 for v in r.values()) for r in self.most.values()) >= nodes

    def __enter__(self) -> Seen:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Load:
    """Uploads sent by `clients` threads, each as soon as its last is answered, until stopped."""

    url: str
    audio: dict[str, np.ndarray]
    clients: int
    answers: list[tuple[str, int, str]] = field(default_factory=list)
    retried: int = 0  # uploads sent again by the client
    _stop: threading.Event = field(default_factory=threading.Event)
    _pool: cf.ThreadPoolExecutor | None = None

    def __enter__(self) -> Load:
        self._pool = cf.ThreadPoolExecutor(self.clients)
        self._futures = [self._pool.submit(self._client, i) for i in range(self.clients)]
        return self

    def _client(self, i: int) -> None:
        n = i
        while not self._stop.is_set():
            clip = CLIPS[n % len(CLIPS)]
            r = transcribe(self.url, *encode(self.audio[clip], "flac"))
            if r.status_code == 500 and not r.text.startswith("{"):
                # Serve's proxy lost the ingress replica the request was on (its node went): the client retries
                # once, as the OpenAI SDK does (twice) on a 500. The ingress's own errors are JSON.
                self.retried += 1
                r = transcribe(self.url, *encode(self.audio[clip], "flac"))
            self.answers.append((clip, r.status_code, r.json().get("text", "") if r.status_code == 200 else r.text))
            n += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        assert self._pool is not None
        self._pool.shutdown()

    def check(self, manifest: dict[str, ManifestClip]) -> None:
        failed = [a for a in self.answers if a[1] != 200]
        assert not failed, f"{len(failed)} of {len(self.answers)} uploads failed: {failed[:3]}"
        for clip, _, text in self.answers:
            check_text(manifest, clip, text)


def test_replicas_on_both_nodes_answer_uploads_and_a_live_session(
    cluster: RayCluster, url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    ready = httpx.get(f"{url}/health/ready", timeout=10).json()
    assert ready["ready"] and ready["model"] == "whisper-base", ready
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def upload(i: int) -> tuple[str, str]:
        clip = CLIPS[i % len(CLIPS)]
        name, data = encode(audio[clip], ("wav", "flac", "ogg", "ulaw")[i % 4])
        return clip, client.audio.transcriptions.create(model="whisper-1", file=(name, data), language="en").text

    # Serve may scale down to one replica as soon as the burst is answered, and a stopped replica's metrics go
    # with it: each replica's count is kept as read, while the uploads run and after.
    with Seen(lambda: by_replica(cluster, "specwhisper_batch_size_count", ENGINE)) as batches:
        with cf.ThreadPoolExecutor(22) as pool:
            uploads = [pool.submit(upload, i) for i in range(20)]
            live = pool.submit(realtime_text, url, audio["ljspeech/LJ001-0001"])
            streamed = pool.submit(sse_text, url, *encode(audio["whisper/jfk"], "flac"))
            for future in uploads:
                check_text(manifest, *future.result())
        check_text(manifest, "ljspeech/LJ001-0001", live.result())
        check_text(manifest, "whisper/jfk", streamed.result())
        # A client's request id comes back once, as from the standalone server; errors keep OpenAI's shape.
        r = httpx.post(
            f"{url}/v1/audio/transcriptions",
            data={"model": "no-such-model"},
            files={"file": encode(audio["whisper/jfk"], "wav")},
            headers={"X-Request-Id": "ray-test-1"},
            timeout=60,
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        assert r.headers.get_list("x-request-id") == ["ray-test-1"]
        # Each node's replica ran batches, as its own metrics (through the node's Ray metrics agent) show.
        wait_for("both nodes' replicas report batches", lambda: batches.on_each(2), 30)
    print(f"batches by node and replica: {batches.most}")
    assert sum(sum(r.values()) for r in batches.most.values()) >= 6  # 22 jobs, batches of 1..4

    def answered() -> float:
        ok = {"route": "/v1/audio/transcriptions", "status": "200"}
        return sum(sum(r.values()) for r in by_replica(cluster, "specwhisper_requests_total", INGRESS, **ok).values())

    # The ingress replicas count the requests as the standalone server does (exported the same way).
    wait_for("the ingress replicas report 21 uploads answered", lambda: answered() >= 21, 30)


def test_killed_replica_loses_nothing_and_is_replaced(
    url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    before = replica_names()
    with Load(url, audio, clients=6) as load:
        wait_for("uploads answered", lambda: len(load.answers) >= 4, 120)
        victim = kill_a_replica()
        took = wait_for(
            "a new replica running",
            lambda: bool(replica_names() - before) and running_replicas() >= 1 and victim not in replica_names(),
            180,
        )
        wait_for("the new replica running", lambda: running_replicas() == len(replica_names()), 180)
    print(f"replica killed under load: {len(load.answers)} uploads answered, replaced in {took:.0f} s")
    load.check(manifest)
    assert load.retried == 0  # the ingress sent the killed replica's jobs to the other one itself
    assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200


def test_autoscaling_down_when_idle_and_up_under_load(
    url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    down = wait_for("idle: 1 replica", lambda: running_replicas() == 1 and len(replica_names()) == 1, 120)
    with Load(url, audio, clients=8) as load:
        up = wait_for("under load: 2 replicas", lambda: running_replicas() == 2, 180)
    again = wait_for("idle again: 1 replica", lambda: running_replicas() == 1 and len(replica_names()) == 1, 120)
    print(f"autoscaling: down to 1 in {down:.0f} s idle, up to 2 in {up:.0f} s under load, down in {again:.0f} s")
    load.check(manifest)


def test_a_rolling_update_drains_the_old_replicas(
    url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """A new version (a changed setting) replaces every replica, ingress and engine, under load: each old one
    stops taking requests, finishes those it has, and goes; nothing is lost or retried."""
    old = replica_names()
    changed = {**ARGS, "settings": {**ARGS["settings"], "batch_window_ms": 5}}  # type: ignore[dict-item]
    with Load(url, audio, clients=4) as load:
        wait_for("uploads answered", lambda: len(load.answers) >= 4, 120)
        serve.run(build(changed), name=APP_NAME, route_prefix="/")  # returns once the new version runs
        took = wait_for("the old replicas gone", lambda: not replica_names() & old, 120)
        answered = len(load.answers)
        wait_for("uploads answered by the new version", lambda: len(load.answers) >= answered + 4, 120)
    print(f"rolling update under load: {len(load.answers)} uploads answered, old replicas gone {took:.0f} s after")
    load.check(manifest)
    assert load.retried == 0


def test_losing_a_node_leaves_the_service_answering(
    cluster: RayCluster, url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    with Load(url, audio, clients=8) as load:
        wait_for("under load: 2 replicas", lambda: running_replicas() == 2, 180)
        answered = len(load.answers)
        cluster.cluster.remove_node(cluster.worker)  # its raylet stops: the replica on it dies
        wait_for("uploads answered after the node left", lambda: len(load.answers) >= answered + 8, 180)
    print(
        f"node removed under load: {len(load.answers)} uploads answered, none lost; {load.retried} retried by the"
        " client (their ingress replica was on the node)"
    )
    load.check(manifest)
    assert httpx.get(f"{url}/health/ready", timeout=10).json()["ready"]
    r = transcribe(url, *encode(audio["whisper/jfk"], "wav"))
    assert r.status_code == 200
    check_text(manifest, "whisper/jfk", r.json()["text"])


def test_a_full_deployment_answers_429_with_retry_after(
    url: str, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    """Backpressure as in the standalone server: with room for one job per replica and one waiting per
    ingress, a burst gets 429s with `Retry-After` in OpenAI's error shape, the rest their text, no 5xx."""
    tiny = {**ARGS, "settings": {**ARGS["settings"], "queue_size": 1, "max_batch": 1}}
    tiny |= {"initial_replicas": 1, "max_replicas": 1}
    serve.run(build(tiny), name=APP_NAME, route_prefix="/")  # type: ignore[arg-type]
    wait_for("ready", lambda: httpx.get(f"{url}/health/ready", timeout=10).status_code == 200, 120)
    data = encode(audio["whisper/jfk"], "flac")
    with cf.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: transcribe(url, *data), range(12)))
    statuses = sorted(r.status_code for r in answers)
    print(f"a burst of 12 against room for 1 running and 1 waiting per ingress: {statuses}")
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    for r in answers:
        if r.status_code == 429:
            assert r.json()["error"]["type"] and r.headers["retry-after"].isdigit(), r.text
        else:
            check_text(manifest, "whisper/jfk", r.json()["text"])
