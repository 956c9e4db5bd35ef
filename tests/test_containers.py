"""The container deployment for real: the images built (docker/build-local.sh), docker-compose.yml run with two
server replicas and the load balancer, then loaded, broken (a replica killed, one stopped while it works,
scaled to three and back) and watched recover. Needs Docker: installed and started here when the tests run
as root with apt (as CI does); elsewhere the module says why it cannot run and the rest of the suite goes on."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

from app.api.audio import load_audio
from app.tools.bench import error_rate
from app.tools.manifest import ManifestClip
from tests.clients import TRANSCRIPTIONS, check_text, encode, realtime_text, sse_text, transcribe
from tests.containers import LB, Deployment, DockerHost, build_images, docker_host, save_layers, tidy

pytestmark = [pytest.mark.slow, pytest.mark.server]

IMAGE = os.environ.get("SPECWHISPER_IMAGE", "specwhisper:cpu")
SLIM_IMAGE = os.environ.get("SPECWHISPER_SLIM_IMAGE", "specwhisper:cpu-slim")
LB_IMAGE = os.environ.get("SPECWHISPER_LB_IMAGE", "specwhisper-lb:latest")
CLIPS = ("whisper/jfk", "ljspeech/LJ001-0001", "ljspeech/LJ001-0002", "pocketsphinx/goforward")
FORMATS = ("wav", "flac", "ogg", "ulaw")
# A pip configuration handed to the build as its `pip_conf` secret: it must not be found in any image layer.
CANARY = "specwhisper-build-secret-canary-7f3c2a91"


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerHost]:
    host = docker_host(tmp_path_factory.mktemp("docker"))
    if isinstance(host, str):
        message = f"container tests cannot run here: {host}"
        print(message)
        pytest.skip(message)
    yield host
    host.stop()


@pytest.fixture(scope="module")
def images(docker: DockerHost, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tidy(docker)  # before building too: a machine that ran many builds may have little disk left
    work = tmp_path_factory.mktemp("images")
    canary = work / "pip.conf"
    canary.write_text(f"# {CANARY}\n[global]\n")
    os.environ["PIP_CONF_SECRET"] = str(canary)
    try:
        sizes = build_images(work / "build.log")
    finally:
        del os.environ["PIP_CONF_SECRET"]
    print("image sizes:", sizes)
    tidy(docker)
    return sizes


@pytest.fixture(scope="module")
def deployment(docker: DockerHost, images: dict[str, str]) -> Iterator[Deployment]:
    env = {
        "SPECWHISPER_IMAGE": IMAGE,
        "SPECWHISPER_LB_IMAGE": LB_IMAGE,
        "SPECWHISPER_THREADS": "1",  # two cores here, shared by the replicas
        "SPECWHISPER_SHUTDOWN_TIMEOUT_S": "60",
        "SPECWHISPER_STOP_GRACE_PERIOD": "90s",
        "SPECWHISPER_LB_CHECK_INTER": "1s",
        "SPECWHISPER_LB_CHECK_FASTINTER": "300ms",
        "SPECWHISPER_LB_CHECK_FALL": "1",
        "SPECWHISPER_LB_CHECK_RISE": "1",
    }
    dep = Deployment(docker, f"swtest{uuid.uuid4().hex[:6]}", env)
    try:
        started = time.monotonic()
        dep.up(replicas=2)
        dep.wait_serving(2)
        print(f"compose up: 2 replicas ready behind the load balancer in {time.monotonic() - started:.1f} s")
        yield dep
    finally:
        dep.down()


@pytest.fixture(scope="module")
def audio(manifest: dict[str, ManifestClip]) -> dict[str, np.ndarray]:
    return {clip: load_audio(manifest[clip].audio) for clip in CLIPS}


def served(dep: Deployment, container: str, status: int = 200) -> int:
    """Transcription requests the replica answered with `status` since it started (its own /metrics)."""
    text = dep.replica_get(container, "/metrics")
    pattern = rf'^specwhisper_requests_total\{{[^}}]*route="{TRANSCRIPTIONS}"[^}}]*status="{status}"[^}}]*\}} (\S+)$'
    return int(sum(float(m) for m in re.findall(pattern, text, re.M)))


def test_images_are_well_made(docker: DockerHost, images: dict[str, str]) -> None:
    assert {IMAGE, SLIM_IMAGE, LB_IMAGE} <= set(images), images
    for image in (IMAGE, SLIM_IMAGE):
        config = json.loads(docker.run("image", "inspect", image).stdout)[0]["Config"]
        assert config["User"] == "specwhisper:specwhisper" and config["Entrypoint"][0] == "/usr/bin/tini"
        assert "/health/ready" in " ".join(config["Healthcheck"]["Test"])
        # No compiler in the runtime image (the kernel library was built in the build stage).
        probe = docker.run("run", "--rm", "--entrypoint", "sh", image, "-c", "command -v gcc g++ cc c++", check=False)
        assert probe.stdout.strip() == "", f"a compiler in {image}: {probe.stdout}"
    lb = json.loads(docker.run("image", "inspect", LB_IMAGE).stdout)[0]["Config"]
    assert lb["User"] == "haproxy" and lb["StopSignal"] == "SIGUSR1"
    # The models are where the image says (SPECWHISPER_MODELS_DIR), readable but not writable by its user.
    listed = docker.run("run", "--rm", "--read-only", IMAGE, "models", "list").stdout
    assert "whisper-base" in listed and "whisper-tiny.en" in listed, listed
    write = docker.run(
        "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", 'touch "$SPECWHISPER_MODELS_DIR/x"', check=False
    )
    assert write.returncode != 0
    slim = docker.run("run", "--rm", "--entrypoint", "sh", SLIM_IMAGE, "-c", 'ls -A "$SPECWHISPER_MODELS_DIR"')
    assert slim.stdout.strip() == "", "the slim image carries no models"


def test_no_build_secret_in_any_layer(docker: DockerHost, images: dict[str, str]) -> None:
    """The build's pip configuration (a canary) and the host's own CA certificates (pip_ca) are in no layer."""
    host_ca = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
    image_ca = docker.run("run", "--rm", "--entrypoint", "cat", IMAGE, "/etc/ssl/certs/ca-certificates.crt").stdout
    certs = re.findall(r"-----BEGIN CERTIFICATE-----\n(.+?)\n", host_ca.read_text() if host_ca.is_file() else "")
    host_only = [c.encode() for c in certs if c not in image_ca]  # e.g. a TLS-intercepting proxy's CA
    needles = [CANARY.encode(), *host_only]
    for image in (IMAGE, SLIM_IMAGE, LB_IMAGE):
        history = docker.run("history", "--no-trunc", image).stdout
        assert CANARY not in history and "pip_ca" not in history.replace("id=pip_ca", "")
        for name, pieces in save_layers(docker, image):
            for data in pieces:
                found = [n[:40] for n in needles if n in data]
                assert not found, f"{image}: {name} holds {found}"


def test_mixed_requests_on_both_replicas(
    deployment: Deployment, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    replicas = deployment.containers()
    before = {c: served(deployment, c) for c in replicas}
    client = OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=180)
    jobs = [(CLIPS[i % len(CLIPS)], FORMATS[(i // len(CLIPS)) % len(FORMATS)]) for i in range(38)]

    def upload(job: tuple[str, str]) -> tuple[str, str, str]:
        clip, kind = job
        name, data = encode(audio[clip], kind)
        text = client.audio.transcriptions.create(model="whisper-1", file=(name, data), language="en").text
        return clip, kind, text

    with cf.ThreadPoolExecutor(4) as pool:
        uploads = pool.map(upload, jobs)
        streamed = pool.submit(sse_text, deployment.url, *encode(audio["whisper/jfk"], "flac"))
        live = pool.submit(realtime_text, deployment.url, audio["ljspeech/LJ001-0001"])
        answers = list(uploads)
    texts: dict[tuple[str, str], set[str]] = {}
    for clip, kind, text in answers:
        check_text(manifest, clip, text)
        texts.setdefault((clip, kind), set()).add(text)
    check_text(manifest, "whisper/jfk", streamed.result())
    check_text(manifest, "ljspeech/LJ001-0001", live.result())
    assert all(len(v) == 1 for v in texts.values()), f"the same upload got different texts: {texts}"
    shares = {c: served(deployment, c) - before[c] for c in replicas}
    assert sum(shares.values()) == 39 and all(n >= 5 for n in shares.values()), shares


def test_replicas_run_as_the_image_says(deployment: Deployment) -> None:
    """tini is PID 1, the server runs as `specwhisper` on a read-only root, health checks pass, and the load
    balancer runs as `haproxy`, also on a read-only root."""
    for container in deployment.containers():
        healthy = lambda: deployment.inspect(container)["State"]["Health"]["Status"] == "healthy"  # noqa: B023, E731
        deployment.wait_for("Docker's health check passing", healthy, timeout=120)
        assert deployment.inspect(container)["HostConfig"]["ReadonlyRootfs"]
        init = deployment.docker.run("exec", container, "cat", "/proc/1/cmdline").stdout.split("\0")
        assert init[0] == "/usr/bin/tini" and init[2:5] == ["python", "-m", "app"], init
        assert deployment.docker.run("exec", container, "id", "-un").stdout.strip() == "specwhisper"
        write = deployment.docker.run("exec", container, "touch", "/opt/venv/x", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr
    (lb,) = deployment.containers(LB)
    assert deployment.inspect(lb)["HostConfig"]["ReadonlyRootfs"]
    assert deployment.docker.run("exec", lb, "id", "-un").stdout.strip() == "haproxy"


def _load(deployment: Deployment, data: tuple[str, bytes], count: int, workers: int) -> cf.Future[list[httpx.Response]]:
    """`count` uploads through the load balancer from `workers` clients, in the background."""
    pool = cf.ThreadPoolExecutor(workers + 1)

    def run() -> list[httpx.Response]:
        with cf.ThreadPoolExecutor(workers) as inner:
            return list(inner.map(lambda _: transcribe(deployment.url, *data), range(count)))

    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def test_killed_replica_loses_nothing_and_comes_back(
    deployment: Deployment, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    victim, other = deployment.containers()
    restarts = deployment.inspect(victim)["RestartCount"]
    retried = deployment.lb_retries()
    load = _load(deployment, encode(audio["ljspeech/LJ001-0001"], "wav"), count=24, workers=4)
    deployment.wait_for("the victim busy", lambda: served(deployment, victim) >= 1, timeout=120)
    # What a crash or the OOM killer does: SIGKILL to the container's init, from outside. (`docker kill` would
    # count as stopping it by hand, and Docker's restart policy leaves such a container down.)
    os.kill(deployment.inspect(victim)["State"]["Pid"], signal.SIGKILL)
    killed = time.monotonic()
    responses = load.result(timeout=600)
    assert [r.status_code for r in responses] == [200] * 24, [r.text[:200] for r in responses if r.status_code != 200]
    for r in responses:
        check_text(manifest, "ljspeech/LJ001-0001", r.json()["text"])
    # The restart policy brings it back; once it says ready the load balancer sends it traffic again.
    deployment.wait_for(
        "the killed replica restarted and healthy",
        lambda: (
            deployment.inspect(victim)["RestartCount"] > restarts
            and deployment.inspect(victim)["State"]["Health"]["Status"] == "healthy"
        ),
        timeout=300,
    )
    deployment.wait_serving(2)
    retries, redispatches = (now - then for now, then in zip(deployment.lb_retries(), retried, strict=True))
    print(
        f"replica killed under load: 24 of 24 uploads answered 200 ({retries} retries, {redispatches} "
        f"redispatched); back and serving {time.monotonic() - killed:.1f} s after the kill"
    )
    for _ in range(6):
        r = transcribe(deployment.url, *encode(audio["pocketsphinx/goforward"], "wav"))
        assert r.status_code == 200
    assert served(deployment, victim) >= 1, "the restarted replica gets traffic again"
    assert served(deployment, other) >= 1

    # `docker kill` under load: nothing is lost either; Docker counts it as stopped by hand and leaves it down
    # (the restart policy does not apply), and `compose up` brings it back.
    load = _load(deployment, encode(audio["ljspeech/LJ001-0001"], "wav"), count=12, workers=4)
    deployment.wait_for("the other busy", lambda: served(deployment, other) >= 2, timeout=120)
    deployment.docker.run("kill", other)
    responses = load.result(timeout=600)
    assert [r.status_code for r in responses] == [200] * 12, [r.text[:200] for r in responses if r.status_code != 200]
    assert deployment.inspect(other)["State"]["Status"] == "exited"
    deployment.up(replicas=2)
    deployment.wait_serving(2)


def test_stopped_replica_drains_its_work(
    deployment: Deployment, audio: dict[str, np.ndarray], manifest: dict[str, ManifestClip]
) -> None:
    victim = deployment.containers()[0]
    long_clip = np.concatenate([audio["whisper/jfk"], audio["ljspeech/LJ001-0001"]] * 2)  # ~41 s: seconds of work
    reference = " ".join([manifest["whisper/jfk"].text, manifest["ljspeech/LJ001-0001"].text] * 2)
    load = _load(deployment, encode(long_clip, "wav"), count=6, workers=6)

    address = deployment.replica_address(victim)
    # In flight on it, as the load balancer counts them (uploads are sent on once whole).
    busy = lambda: int(deployment.lb_rows()[address]["scur"]) >= 2  # noqa: E731
    deployment.wait_for("the replica working on uploads", busy, timeout=60)
    in_flight = int(deployment.lb_rows()[address]["scur"])
    began = time.monotonic()
    stopped = subprocess.Popen([deployment.docker.cli, "stop", "-t", "90", victim], stdout=subprocess.DEVNULL)
    responses = load.result(timeout=600)
    assert stopped.wait(120) == 0
    took = time.monotonic() - began
    assert [r.status_code for r in responses] == [200] * 6, [r.text[:300] for r in responses if r.status_code != 200]
    print(f"replica stopped with {in_flight} requests in flight: all 6 answered 200, the stop took {took:.1f} s")
    for r in responses:
        wer = error_rate([(reference, r.json()["text"], "en")])
        assert wer <= 0.25, r.json()["text"]
    # It stopped by itself, not killed when the grace period ran out (uvicorn re-raises the SIGTERM it handled
    # once its shutdown is complete: 143 through tini), and finished requests after SIGTERM: drained, not cut.
    state = deployment.inspect(victim)["State"]
    assert state["Status"] == "exited" and state["ExitCode"] in (0, 143) and not state["OOMKilled"], state
    logs = deployment.docker.run("logs", victim).stderr + deployment.docker.run("logs", victim).stdout
    assert "Traceback" not in logs, logs[-3000:]
    shutdown = logs.find("Shutting down")
    assert shutdown >= 0 and f"POST {TRANSCRIPTIONS}" in logs[shutdown:], logs[-3000:]
    assert "Application shutdown complete" in logs[shutdown:], logs[-3000:]
    deployment.docker.run("start", victim)
    deployment.wait_serving(2)


def test_scale_to_three_and_back(deployment: Deployment, audio: dict[str, np.ndarray]) -> None:
    began = time.monotonic()
    deployment.up(replicas=3)
    three = deployment.wait_serving(3)
    print(f"scaled to 3: the third replica serving after {time.monotonic() - began:.1f} s")
    before = {c: served(deployment, c) for c in three}
    data = encode(audio["pocketsphinx/goforward"], "wav")
    after = before
    for _ in range(6):  # rounds of 3 at a time until each replica has served (leastconn, not round robin)
        with cf.ThreadPoolExecutor(3) as pool:
            codes = [r.status_code for r in pool.map(lambda _: transcribe(deployment.url, *data), range(6))]
        assert codes == [200] * 6
        after = {c: served(deployment, c) for c in three}
        if all(after[c] > before[c] for c in three):
            break
    assert all(after[c] > before[c] for c in three), f"each replica, the new one too, served: {before} -> {after}"
    deployment.up(replicas=2)
    deployment.wait_serving(2)
    assert len(deployment.containers(LB)) == 1
    for _ in range(4):
        assert transcribe(deployment.url, *data).status_code == 200
