"""Docker on the test machine, for tests/test_containers.py: a daemon (Debian's docker.io installed and dockerd
started when they are missing and the tests run as root; stopped again afterwards), the project's images
(docker/build-local.sh), and a compose deployment of them to drive and break."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "specwhisper"
LB = "lb"


def _ok(*cmd: str, timeout: float = 30) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class DockerHost:
    """A working Docker daemon and clients: `docker` and compose (v2 plugin, else v1 `docker-compose`)."""

    cli: str
    compose: list[str]
    daemon: subprocess.Popen[bytes] | None = None  # dockerd, if this run started it
    log: Path | None = None

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.cli, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def stop(self) -> None:
        """Stop the daemon if this run started it (its images stay on disk: the next run's builds are cached)."""
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()


def _apt_install(packages: Sequence[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        check=True,
        capture_output=True,
        env=env,
        timeout=900,
    )


def docker_host(log_dir: Path) -> DockerHost | str:
    """Docker ready to use, or why it cannot be had here (a reason to print)."""
    root = os.geteuid() == 0 and shutil.which("apt-get") is not None
    missing = [
        package
        for package, present in (
            ("docker.io", shutil.which("dockerd") is not None),
            ("docker-compose", shutil.which("docker-compose") is not None or _ok("docker", "compose", "version")),
            (
                "debootstrap",
                shutil.which("debootstrap") is not None or shutil.which("/usr/sbin/debootstrap") is not None,
            ),
        )
        if not present
    ]
    if missing:
        if not root:
            return f"Docker is not installed and these tests are not run as root with apt ({', '.join(missing)})"
        try:
            _apt_install(missing)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            return f"could not install {', '.join(missing)}: {e}"
    cli = "docker" if shutil.which("docker") else "/usr/bin/docker"
    compose = ["docker", "compose"] if _ok(cli, "compose", "version") else ["docker-compose"]
    host = DockerHost(cli, compose)
    if _ok(cli, "info"):
        return host
    if not root:
        return "no Docker daemon answers, and these tests are not run as root to start one"
    host.log = log_dir / "dockerd.log"
    host.daemon = subprocess.Popen(
        ["dockerd"], stdout=host.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if host.daemon.poll() is not None:
            return f"dockerd exited with {host.daemon.returncode}: {host.log.read_text()[-2000:]}"
        if _ok(cli, "info", timeout=5):
            return host
        time.sleep(0.5)
    host.stop()
    return f"dockerd did not answer within 60 s: {host.log.read_text()[-2000:]}"


def build_images(log: Path) -> dict[str, str]:
    """docker/build-local.sh (cached layers make a rebuild quick); the images' tags -> sizes as it reports them."""
    with log.open("w") as out:
        done = subprocess.run(
            ["bash", str(ROOT / "docker" / "build-local.sh")],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=1800,
            cwd=ROOT,
        )
    text = log.read_text()
    assert done.returncode == 0, f"docker/build-local.sh failed:\n{text[-6000:]}"
    return dict(line.split("\t", 1) for line in text.splitlines() if line.count("\t") == 1 and " MB" in line)


def tidy(docker: DockerHost, keep_cache: str = "12GB") -> None:
    """Keep a test machine's disk from filling over many runs: remove untagged images of this project (left by
    builds before docker/build-local.sh removed them itself; by label, or by the project's user for older
    images without one) and cap the build cache, oldest first. Nothing else on the daemon is touched."""
    listed = docker.run("images", "--filter", "dangling=true", "--quiet", "--no-trunc").stdout.split()
    for image in dict.fromkeys(listed):
        config = json.loads(docker.run("image", "inspect", image).stdout)[0]["Config"]
        title = (config.get("Labels") or {}).get("org.opencontainers.image.title", "")
        if title.startswith("specwhisper") or config.get("User") == "specwhisper:specwhisper":
            docker.run("image", "rm", image, check=False)  # fails, harmlessly, if a container uses it
    docker.run("builder", "prune", "--force", "--keep-storage", keep_cache, check=False, timeout=600)


def save_layers(docker: DockerHost, image: str) -> Iterator[tuple[str, Iterator[bytes]]]:
    """`docker save IMAGE` read as it streams (an image can be larger than the free space in /tmp): each file
    of the archive (manifest, config, layer tars) as (name, its bytes in pieces that overlap by 64 KiB, so a
    string shorter than that is whole in at least one piece)."""
    overlap, piece = 1 << 16, 1 << 24
    with subprocess.Popen([docker.cli, "save", image], stdout=subprocess.PIPE) as save:
        assert save.stdout is not None
        with tarfile.open(fileobj=save.stdout, mode="r|") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                blob = archive.extractfile(member)
                assert blob is not None

                def pieces(blob: IO[bytes] = blob) -> Iterator[bytes]:
                    tail = b""
                    while data := blob.read(piece):
                        yield tail + data
                        tail = data[-overlap:]

                yield member.name, pieces()
        assert save.wait(600) == 0, f"docker save {image} failed"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Deployment:
    """`docker-compose.yml` as a project of its own: server replicas behind the load balancer on loopback ports."""

    docker: DockerHost
    project: str
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "SPECWHISPER_LB_PUBLISH": f"127.0.0.1:{self.port}",
            "SPECWHISPER_LB_STATS_PUBLISH": str(self.stats_port),
            **self.env,
        }

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = [*self.docker.compose, "-p", self.project, "-f", str(ROOT / "docker-compose.yml"), *args]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **self.env}
        )
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def up(self, replicas: int) -> None:
        self.compose("up", "-d", "--no-build", "--scale", f"{SERVICE}={replicas}")

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "5")

    def containers(self, service: str = SERVICE, *, all_states: bool = False) -> list[str]:
        args = ["ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}"]
        args += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.docker.run(*(args + (["-a"] if all_states else []))).stdout.split()

    def inspect(self, container: str) -> dict:
        return json.loads(self.docker.run("inspect", container).stdout)[0]

    def replica_address(self, container: str) -> str:
        networks = self.inspect(container)["NetworkSettings"]["Networks"]
        return next(iter(networks.values()))["IPAddress"]

    def in_container(self, container: str, code: str, timeout: float = 30) -> str:
        """Python run inside the container (its own interpreter and network): what it prints."""
        return self.docker.run("exec", container, "python", "-c", code, timeout=timeout).stdout

    def replica_get(self, container: str, path: str) -> str:
        """GET http://127.0.0.1:8000{path} from inside the replica."""
        url = f"http://127.0.0.1:8000{path}"
        code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=10).read().decode())"
        try:
            return self.in_container(container, code)
        except AssertionError as e:
            state = self.inspect(container)["State"]
            logs = self.docker.run("logs", "--tail", "40", container, check=False)
            raise AssertionError(f"{e}\nstate: {state}\nlogs:\n{logs.stdout}{logs.stderr}") from None

    def lb_rows(self) -> dict[str, dict[str, str]]:
        """Replica address -> the load balancer's statistics row of its slot (for the slots with an address)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        return {
            r["addr"].rsplit(":", 1)[0]: r
            for r in csv.DictReader(io.StringIO(text))
            if r["pxname"] == "specwhisper" and r["svname"].startswith("cpu") and r.get("addr")
        }

    def lb_retries(self) -> tuple[int, int]:
        """The load balancer's retries and redispatches to another replica so far (its backend's counters)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        row = next(
            r for r in csv.DictReader(io.StringIO(text)) if r["pxname"] == "specwhisper" and r["svname"] == "BACKEND"
        )
        return int(row["wretr"] or 0), int(row["wredis"] or 0)

    def lb_servers(self) -> dict[str, str]:
        """Replica address -> the load balancer's state of it (UP, DOWN, ...)."""
        return {address: row["status"].split()[0] for address, row in self.lb_rows().items()}

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (httpx.HTTPError, AssertionError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"not reached within {timeout} s: {what}\n{self.logs()}")

    def wait_serving(self, replicas: int, timeout: float = 300) -> list[str]:
        """Wait until `replicas` replicas run and the load balancer has exactly them UP; their container ids."""

        def serving() -> bool:
            ids = self.containers()
            if len(ids) != replicas or any(self.inspect(c)["State"]["Status"] != "running" for c in ids):
                return False
            addresses = {self.replica_address(c) for c in ids}
            state = self.lb_servers()
            if {a for a, s in state.items() if s == "UP"} != addresses:
                return False
            return all(json.loads(self.replica_get(c, "/health/ready"))["ready"] for c in ids)

        self.wait_for(f"{replicas} replicas UP behind the load balancer", serving, timeout)
        return self.containers()

    def logs(self, tail: int = 60) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), timeout=60).stdout[-8000:]
        except (AssertionError, subprocess.TimeoutExpired) as e:
            return f"(no logs: {e})"
