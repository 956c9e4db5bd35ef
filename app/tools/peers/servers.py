"""The servers a peer benchmark drives: SpecWhisper and each peer, as child processes on loopback ports.

Every server is launched with the same thread count, loads the same Whisper weights and decodes greedily;
what differs is stated in `describe()` (the report carries it). A server's memory is its process tree's
resident set, sampled while it runs (`RssSampler`): SpecWhisper's web process and worker together, a peer's
one process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.tools.peers.install import RECIPES, ct2_weights, ensure_env
from app.tools.process import ensure_may_start, free_port, wait_until_ready

LiveProtocol = Literal["openai-realtime", "whisperlive"]
PEERS = ("whisperlive", "faster-whisper-server")


class RssSampler:
    """The peak resident set (MB) of a process and its descendants, sampled every `interval` s in a thread.

    `take()` returns the peak since the last `take()` (so each benchmark level gets its own) and the peak of
    the whole run is `overall`.
    """

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        try:
            import psutil
        except ImportError as exc:
            raise ImportError("peerbench measures memory with psutil: install the `bench` extra") from exc

        self._root = psutil.Process(pid)
        self._interval = interval
        self._peak = self.overall = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _sample(self) -> float:
        import psutil

        total = 0
        try:
            for proc in (self._root, *self._root.children(recursive=True)):
                with contextlib.suppress(psutil.Error):  # a child that just exited
                    total += proc.memory_info().rss
        except psutil.Error:
            return 0.0
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            mb = self._sample()
            self._peak, self.overall = max(self._peak, mb), max(self.overall, mb)

    def take(self) -> float:
        peak, self._peak = max(self._peak, self._sample()), 0.0
        self.overall = max(self.overall, peak)
        return round(peak, 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class BenchServer:
    """One server under test: how to start it, where its APIs are, and what it runs."""

    name: str
    command: list[str]
    env: dict[str, str]
    upload_url: str  # base URL of its OpenAI-compatible REST API
    ready_url: str  # 200 once it answers (a peer loading its model on first use gets a warm-up request too)
    live: LiveProtocol | None
    live_url: str | None
    setup: dict[str, Any] = field(default_factory=dict)  # what the report states about it
    proc: subprocess.Popen[bytes] | None = None
    rss: RssSampler | None = None
    log: Path | None = None

    def launch(self, log_dir: Path) -> BenchServer:
        ensure_may_start()
        self.log = log_dir / f"{self.name}.log"
        out = open(self.log, "wb")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.rss = RssSampler(self.proc.pid)
        return self

    def wait_ready(self, timeout: float = 300) -> None:
        wait_until_ready(self.proc, self.ready_url, timeout, self.name, self.log)

    def stop(self, timeout: float = 30) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _thread_env(threads: int) -> dict[str, str]:
    """Every library's thread count pinned (CTranslate2 and onnxruntime read OMP_NUM_THREADS)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def specwhisper(threads: int, model: str, settings: dict[str, str] | None = None) -> BenchServer:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**_thread_env(threads), "SPECWHISPER_THREADS": str(threads), "SPECWHISPER_MODEL": model, **(settings or {})}
    return BenchServer(
        name="specwhisper",
        command=[sys.executable, "-m", "app", "serve", "--port", str(port)],
        env=env,
        upload_url=url,
        ready_url=f"{url}/health/ready",
        live="openai-realtime",
        live_url=url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
        setup={
            "version": _version("specwhisper"),
            "engine": f"{model} (fp32) with its int8 self-draft, exact speculative decoding, adaptive batching 1..4",
            "decoding": "greedy (temperature 0 with openai-whisper's fallback)",
            "threads": threads,
            "settings": settings or {},
        },
    )


def faster_whisper_server(threads: int, model: str, root: Path | None, work: Path) -> BenchServer:
    python = ensure_env("faster-whisper-server", root)
    weights = ct2_weights(model, root)
    port = free_port()
    config = work / "faster-whisper-server.yaml"
    # Its config names the model the request asks for: it reads the form field `model_name` (whisper-1 by
    # default), not OpenAI's `model`. Greedy and the thread count are its documented per-model options.
    config.write_text(
        "models:\n"
        "  - name: whisper-1\n"
        f"    path: {weights}\n"
        "    batch_size: 1\n"
        f"    model_options: {{device: cpu, cpu_threads: {threads}}}\n"
        "    transcribe_options: {beam_size: 1}\n"
    )
    url = f"http://127.0.0.1:{port}"
    return BenchServer(
        name="faster-whisper-server",
        command=[
            str(python),
            "-m",
            "faster_whisper_server",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=_thread_env(threads),
        upload_url=url,
        ready_url=f"{url}/health",
        live=None,
        live_url=None,
        setup={
            "version": "faster-whisper-server 0.0.3 (faster-whisper >= 1.2.1)",
            "engine": f"faster-whisper WhisperModel on {model}'s CTranslate2 weights, compute_type 'default' "
            "(the stored fp16 runs as fp32 on a CPU), batch_size 1 (its default: no BatchedInferencePipeline)",
            "decoding": "greedy (beam_size 1 in its config; its temperature fallback as faster-whisper's default)",
            "threads": threads,
            "install": RECIPES["faster-whisper-server"].note,
            "live": "none: it has no live-audio protocol",
        },
    )


def whisperlive(threads: int, model: str, root: Path | None, max_clients: int = 16) -> BenchServer:
    python = ensure_env("whisperlive", root)
    weights = ct2_weights(model, root)
    port, rest_port = free_port(), free_port()
    launcher = Path(__file__).parent / "launchers" / "whisperlive.py"
    rest = f"http://127.0.0.1:{rest_port}"
    return BenchServer(
        name="whisperlive",
        command=[
            str(python),
            str(launcher),
            "--model",
            str(weights),
            "--port",
            str(port),
            "--rest-port",
            str(rest_port),
            "--max-clients",
            str(max_clients),
        ],
        env={**_thread_env(threads), "PYTHONUNBUFFERED": "1"},
        upload_url=rest,
        ready_url=f"{rest}/health",
        live="whisperlive",
        live_url=f"ws://127.0.0.1:{port}",
        setup={
            "version": "whisper-live 0.10.0 (faster-whisper 1.2.0)",
            "engine": f"faster_whisper backend on {model}'s CTranslate2 weights, int8 on a CPU (its choice), "
            "one model shared by all clients (single_model), no cross-client batching (its default)",
            "decoding": "greedy (beam_size 1 made the default of transcribe: it passes none, and faster-whisper's "
            "is 5); REST: temperature 0, no fallback (its endpoint's default); live: faster-whisper's fallback",
            "live_options": "use_vad true (faster-whisper's Silero VAD on each pass), send_last_n_segments 10, "
            "no_speech_thresh 0.45, same_output_threshold 10: its client's defaults",
            "threads": threads,
            "install": RECIPES["whisperlive"].note,
        },
    )


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{distribution} {version(distribution)}"
    except PackageNotFoundError:
        return distribution


def build(
    names: list[str], threads: int, model: str, root: Path | None, settings: dict[str, str] | None
) -> list[BenchServer]:
    """SpecWhisper and the peers named (set up on first use), not yet started."""
    work = Path(tempfile.mkdtemp(prefix="specwhisper-peers-"))
    servers = [specwhisper(threads, model, settings)]
    for name in names:
        if name == "whisperlive":
            servers.append(whisperlive(threads, model, root))
        elif name == "faster-whisper-server":
            servers.append(faster_whisper_server(threads, model, root, work))
        else:
            raise ValueError(f"unknown peer {name!r} (known: {', '.join(PEERS)})")
    return servers
