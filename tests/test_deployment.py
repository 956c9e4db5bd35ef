"""Deployment: the compose file, and the real load balancer (HAProxy, docker/haproxy/haproxy.cfg) in front of two
real server replicas on loopback, found through DNS as in Docker (a small DNS responder plays Docker's)."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server import ServerProcess, metric, running, starts_server

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "docker" / "haproxy" / "haproxy.cfg"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
REPLICA_NAME = "replicas.specwhisper.test"
REPLICA_IPS = ("127.0.0.2", "127.0.0.3")


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None)
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("haproxy is required in CI (scripts/system-deps.sh installs it)")
    pytest.skip("haproxy is not installed (run scripts/system-deps.sh)")


def free_port_on_all() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


class DnsResponder:
    """Answers A queries for a few names over UDP, like Docker's embedded DNS does for a scaled service."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                packet, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            reply = self.answer(packet)
            if reply:
                self.sock.sendto(reply, peer)

    def answer(self, packet: bytes) -> bytes | None:
        if len(packet) < 12:
            return None
        query_id, flags, qdcount = struct.unpack("!HHH", packet[:6])
        if qdcount != 1:
            return None
        labels, pos = [], 12
        while pos < len(packet) and packet[pos]:
            labels.append(packet[pos + 1 : pos + 1 + packet[pos]].decode("ascii", "replace").lower())
            pos += 1 + packet[pos]
        qtype = struct.unpack("!H", packet[pos + 1 : pos + 3])[0]
        question = packet[12 : pos + 5]
        addresses = self.records.get(".".join(labels))
        rcode = 3 if addresses is None else 0  # NXDOMAIN for names we do not serve
        answers = [a for a in (addresses or []) if qtype == 1]
        header = struct.pack("!HHHHHH", query_id, 0x8400 | (flags & 0x0100) | 0x0080 | rcode, 1, len(answers), 0, 0)
        body = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(a) for a in answers)
        return header + question + body

    def close(self) -> None:
        self.sock.close()


class LoadBalancer:
    """HAProxy on the repository's config; all differences from the compose deployment come from the environment."""

    def __init__(self, dns: DnsResponder, replica_port: int, log: Path, **overrides: str) -> None:
        self.port, self.stats_port = free_port_on_all(), free_port_on_all()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            "SPECWHISPER_LB_BIND": f"127.0.0.1:{self.port}",
            "SPECWHISPER_LB_STATS_BIND": f"127.0.0.1:{self.stats_port}",
            "SPECWHISPER_LB_DNS": dns.address,
            "SPECWHISPER_LB_UPSTREAM": f"{REPLICA_NAME}:{replica_port}",
            "SPECWHISPER_LB_UPSTREAM_GPU": f"gpu.specwhisper.test:{replica_port}",  # no GPU replicas: NXDOMAIN
            "SPECWHISPER_LB_SLOTS": "4",
            "SPECWHISPER_LB_CHECK_INTER": "300ms",
            "SPECWHISPER_LB_CHECK_FASTINTER": "200ms",
            "SPECWHISPER_LB_CHECK_TIMEOUT": "1s",
            "SPECWHISPER_LB_CHECK_FALL": "1",
            "SPECWHISPER_LB_CHECK_RISE": "1",
            **overrides,
        }
        self.log = log
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-W", "-db", "-f", str(HAPROXY_CFG)],
            env={**os.environ, **env},
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def servers(self) -> dict[str, str]:
        """Replica address -> HAProxy's state of it (UP, DOWN, ...), for the slots that have an address."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            r["addr"].rsplit(":", 1)[0]: r["status"].split()[0]
            for r in rows
            if r["pxname"] == "specwhisper" and r["svname"].startswith("cpu") and r.get("addr")
        }

    def wait_for(self, want: Callable[[dict[str, str]], bool], timeout: float = 30) -> dict[str, str]:
        deadline, state = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                state = self.servers()
            except httpx.HTTPError:
                state = {}
            if want(state):
                return state
            time.sleep(0.1)
        raise AssertionError(f"load balancer state not reached: {state}\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def all_up(state: dict[str, str]) -> bool:
    return all(state.get(ip) == "UP" for ip in REPLICA_IPS)


def served(replica: ServerProcess, status: int = 200) -> int:
    """How many transcription requests the replica answered with `status` (its own Prometheus counter)."""
    return int(metric(replica, "specwhisper_requests_total", 0.0, route=TRANSCRIPTIONS, status=str(status)))


@pytest.fixture(scope="module")
def clip(benchdata: Path) -> bytes:
    return (benchdata / "audio/pocketsphinx/goforward.wav").read_bytes()


@pytest.fixture(scope="module")
@starts_server
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    haproxy_binary()
    port = free_port_on_all()
    logs = tmp_path_factory.mktemp("replicas")
    # Small queues so that backpressure (429) is reachable with a handful of requests.
    env = {"SPECWHISPER_THREADS": "1", "SPECWHISPER_MAX_BATCH": "1", "SPECWHISPER_QUEUE_SIZE": "3"}
    procs = {}
    for ip in REPLICA_IPS:
        srv = ServerProcess({**env, "SPECWHISPER_HOST": ip}, log=logs / f"{ip}.log")
        srv.port, srv.url = port, f"http://{ip}:{port}"
        procs[ip] = srv
    with running(*procs.values()):  # both models load at once; a replica a test stopped is continued to stop
        yield procs


@pytest.fixture(scope="module")
def dns() -> Iterator[DnsResponder]:
    responder = DnsResponder({REPLICA_NAME: list(REPLICA_IPS)})
    yield responder
    responder.close()


@pytest.fixture
def make_lb(
    replicas: dict[str, ServerProcess], dns: DnsResponder, tmp_path: Path
) -> Iterator[Callable[..., LoadBalancer]]:
    started: list[LoadBalancer] = []
    port = next(iter(replicas.values())).port

    def make(**overrides: str) -> LoadBalancer:
        lb = LoadBalancer(dns, port, tmp_path / f"haproxy-{len(started)}.log", **overrides)
        started.append(lb)
        lb.wait_for(all_up)
        return lb

    yield make
    for lb in started:
        lb.stop()


def transcribe(url: str, audio: bytes) -> httpx.Response:
    files = {"file": ("a.wav", audio)}
    return httpx.post(f"{url}{TRANSCRIPTIONS}", data={"model": "whisper-1"}, files=files, timeout=120)


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    cpu, gpu, lb = services["specwhisper"], services["specwhisper-gpu"], services["lb"]
    assert "replicas" in cpu["deploy"] and gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    for service in (cpu, gpu):
        assert "ports" not in service, "replicas are reached through the load balancer only"
        assert service["healthcheck"]["test"][0] == "CMD"
    assert "name" not in compose, "Compose v1 rejects a top-level name: the project name goes on the command line"
    # The load balancer's image carries the configuration this module runs on loopback.
    assert lb["build"]["dockerfile"] == "docker/haproxy/Dockerfile"
    assert (
        "COPY docker/haproxy/haproxy.cfg /usr/local/etc/haproxy/haproxy.cfg"
        in (ROOT / lb["build"]["dockerfile"]).read_text()
    )
    assert lb["stop_signal"] == "SIGUSR1" and cpu["read_only"] and lb["read_only"]
    for dockerfile in (ROOT / "Dockerfile", ROOT / "docker" / "Dockerfile.gpu"):
        text = dockerfile.read_text()
        assert "HEALTHCHECK" in text and "/health/ready" in text and re.search(r"^USER \S+", text, re.M)
        entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
        assert entry and json.loads(entry.group(1))[0] == "/usr/bin/tini", "exec form, signals forwarded"


def test_docker_compose_config_validates() -> None:
    """Both Compose v2 (`docker compose`) and v1 (`docker-compose`) accept the file, where they are installed."""
    clients = []
    docker = shutil.which("docker")
    if docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        clients.append([docker, "compose"])
    if shutil.which("docker-compose") is not None:
        clients.append(["docker-compose"])
    if not clients:
        pytest.skip("no Compose client here (tests/test_containers.py installs one where it can)")
    for client in clients:
        for profiles in ([], ["--profile", "gpu", "--profile", "monitoring"]):
            done = subprocess.run(
                [*client, "-p", "specwhisper", "-f", str(ROOT / "docker-compose.yml"), *profiles, "config", "--quiet"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            assert done.returncode == 0, f"{client}: {done.stderr}"


def test_haproxy_config_is_valid() -> None:
    done = subprocess.run([haproxy_binary(), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True)
    assert done.returncode == 0 and "ALERT" not in done.stderr + done.stdout, done.stderr


@pytest.mark.slow
def test_requests_are_spread_over_replicas(
    replicas: dict[str, ServerProcess], make_lb: Callable[..., LoadBalancer], clip: bytes
) -> None:
    lb = make_lb()
    before = {ip: served(srv) for ip, srv in replicas.items()}
    for _ in range(6):
        r = transcribe(lb.url, clip)
        assert r.status_code == 200 and "go forward" in r.json()["text"].lower(), r.text
    after = {ip: served(srv) for ip, srv in replicas.items()}
    shares = {ip: after[ip] - before[ip] for ip in replicas}
    assert sum(shares.values()) == 6 and all(n >= 2 for n in shares.values()), shares
    # The upload limit is enforced at the edge, in the API's error shape, before the body is read.
    with socket.create_connection(("127.0.0.1", lb.port), timeout=10) as s:
        s.sendall(f"POST {TRANSCRIPTIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: 30000000\r\n\r\n".encode())
        head, _, body = s.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["code"] == "file_too_large"


@pytest.mark.slow
def test_unready_replica_is_drained_then_readmitted(
    replicas: dict[str, ServerProcess], make_lb: Callable[..., LoadBalancer], clip: bytes
) -> None:
    lb = make_lb()
    a, b = (replicas[ip] for ip in REPLICA_IPS)
    ip_a, ip_b = REPLICA_IPS

    # Not ready: the worker dies, the replica reloads it and says 503 on /health/ready meanwhile.
    os.kill(httpx.get(f"{a.url}/health/ready").json()["worker_pid"], signal.SIGKILL)
    lb.wait_for(lambda s: s.get(ip_a) == "DOWN" and s.get(ip_b) == "UP", timeout=10)
    before_a, before_b = served(a), served(b)
    for _ in range(3):
        assert transcribe(lb.url, clip).status_code == 200
    assert served(b) - before_b == 3 and served(a) == before_a
    a.wait_ready(120)
    lb.wait_for(all_up, timeout=10)

    # Hung: the replica process stops answering at all (checks time out).
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        lb.wait_for(lambda s: s.get(ip_a) == "DOWN", timeout=10)
        before_b = served(b)
        for _ in range(2):
            assert transcribe(lb.url, clip).status_code == 200
        assert served(b) - before_b == 2
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert served(a) == before_a
    lb.wait_for(all_up, timeout=15)
    for _ in range(4):
        assert transcribe(lb.url, clip).status_code == 200
    assert served(a) > before_a, "a replica that is ready again gets traffic again"


@pytest.mark.slow
def test_backpressure_503_retried_elsewhere_429_passed_through(
    replicas: dict[str, ServerProcess], make_lb: Callable[..., LoadBalancer], clip: bytes
) -> None:
    # Health checks slowed to a crawl: what keeps clients whole here is the retry of the upload alone.
    lb = make_lb(SPECWHISPER_LB_CHECK_INTER="1h", SPECWHISPER_LB_CHECK_FASTINTER="1h", SPECWHISPER_LB_CHECK_FALL="1000")
    a = replicas[REPLICA_IPS[0]]
    refused_before = served(a, 503)
    os.kill(httpx.get(f"{a.url}/health/ready").json()["worker_pid"], signal.SIGKILL)
    time.sleep(0.3)
    with cf.ThreadPoolExecutor(2) as pool:
        codes = [r.status_code for r in pool.map(lambda _: transcribe(lb.url, clip), range(2))]
    assert codes == [200, 200]
    assert served(a, 503) > refused_before, "replica A refused (503) and the upload was replayed on B"
    a.wait_ready(120)

    # Every replica full (1 decoding, 2 uploads waiting; one queue slot stays free for live audio): the rest get
    # the replicas' 429 with its Retry-After.
    with cf.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: transcribe(lb.url, clip), range(12)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["retry-after"]) >= 1 and limited.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.slow
def test_realtime_websocket_passes_through(make_lb: Callable[..., LoadBalancer]) -> None:
    from websockets.sync.client import connect

    lb = make_lb()
    with connect(f"ws://127.0.0.1:{lb.port}/v1/realtime?intent=transcription", open_timeout=20) as ws:
        event = json.loads(ws.recv(timeout=20))
    assert event["type"] == "session.created"
