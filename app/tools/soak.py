"""`python -m app soak`: long mixed traffic (uploads + live WebSocket sessions) with a leak verdict.

The server is started here (or given by `--url` and `--server-pid`). After a warm-up the traffic pauses,
the server settles and a baseline is taken; at the end the traffic stops and the final sample is
compared with it: resident memory (web and worker process), open file descriptors, threads, asyncio
tasks of the web process and /dev/shm mappings. Every answer is checked against the clip's reference
text along the way. Prints one JSON object; exit status 0 when the verdict passes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import re
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.server.memory import ProcessMemory
from app.tools.loadtest import Clip, add_clip_arguments, clips_from_args
from app.tools.process import ServerProcess, add_server_arguments, print_verdict
from app.tools.scrape import sample_value, scrape_metrics

RSS_GROWTH_LIMIT = 0.05
FD_SLACK = 2  # a connection closing while we sample is not a leak; a leak grows with traffic
THREAD_SLACK = 2
CHUNK_S = 0.1


def proc_stats(pid: int) -> dict[str, int]:
    """Resident memory (kB), open fds, threads and /dev/shm mappings of a live process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    memory = ProcessMemory.from_status(status)
    rss = memory.rss // 1024 if memory is not None else 0
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    fd_dir = Path(f"/proc/{pid}/fd")
    fds = 0
    shm = set()
    for fd in fd_dir.iterdir():
        fds += 1
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                shm.add(target)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/dev/shm/" in line:
            shm.add(line.split()[-1])
    return {"rss_kb": rss, "fds": fds, "threads": threads, "shm": len(shm)}


def shm_entries() -> int:
    try:
        return len(os.listdir("/dev/shm"))
    except OSError:
        return -1


@dataclass
class Traffic:
    """Counters of the mixed traffic; every answer is checked."""

    statuses: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    uploads: int = 0
    live_utterances: int = 0
    inflight: int = 0


def _wav(pcm: np.ndarray) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, pcm, 16000, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _pcm16(clip: Clip) -> np.ndarray:
    from app.api.audio import decode_audio

    audio = decode_audio(clip.data)
    return (np.clip(audio, -1, 32767 / 32768) * 32768).astype(np.int16)


class Soak:
    def __init__(self, url: str, clips: list[Clip], uploads: int, live: int, speedup: float) -> None:
        self.url = url
        self.clips = clips
        self.upload_clients = uploads
        self.live_clients = live
        self.speedup = speedup
        self.traffic = Traffic()
        self.live_pcm: list[tuple[np.ndarray, str]] = []

    async def prepare(self) -> None:
        """Reference texts: each clip uploaded alone, and its pcm16 rendering (what live sessions send)."""
        from app.tools.loadtest import reference_texts

        self.clips = await reference_texts(self.url, self.clips)
        pcm = [_pcm16(c) for c in self.clips]
        refs = await reference_texts(
            self.url, [Clip(f"{c.name}.pcm16", _wav(p), c.seconds) for c, p in zip(self.clips, pcm, strict=True)]
        )
        self.live_pcm = [(p, r.expected) for p, r in zip(pcm, refs, strict=True)]

    async def _upload_loop(self, index: int, until: float) -> None:
        import httpx

        from app.tools.loadtest import transcribe

        n = 0
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < until:
                clip = self.clips[(index + n) % len(self.clips)]
                n += 1
                self.traffic.inflight += 1
                try:
                    r = await transcribe(client, self.url, clip, f"soak-{uuid.uuid4().hex}")
                except httpx.HTTPError as exc:
                    self.traffic.failures.append(f"upload: {type(exc).__name__}")
                    continue
                finally:
                    self.traffic.inflight -= 1
                self.traffic.statuses[str(r.status_code)] += 1
                self.traffic.uploads += 1
                if r.status_code == 200 and r.json()["text"] != clip.expected:
                    self.traffic.wrong.append(clip.name)
                elif r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                elif r.status_code != 200:
                    self.traffic.failures.append(f"upload: {r.status_code} {r.text[:200]}")

    async def _live_once(self, pcm: np.ndarray, expected: str) -> None:
        from websockets.asyncio.client import connect

        ws_url = self.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        async with connect(ws_url, max_size=None) as ws:
            update = {"input_audio_sample_rate": 16000, "turn_detection": None}
            await ws.send(json.dumps({"type": "transcription_session.update", "session": update}))
            step = int(16000 * CHUNK_S)

            async def stream() -> None:
                for i in range(0, pcm.size, step):
                    chunk = base64.b64encode(pcm[i : i + step].astype("<i2").tobytes()).decode()
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                    await asyncio.sleep(CHUNK_S / self.speedup)
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

            sender = asyncio.create_task(stream())
            try:
                async for message in ws:
                    event = json.loads(message)
                    if event["type"] == "error":
                        self.traffic.failures.append(f"live: {event['error']}")
                        return
                    if event["type"].endswith("transcription.failed"):
                        self.traffic.failures.append(f"live: {event['error']}")
                        return
                    if event["type"].endswith("transcription.completed"):
                        self.traffic.live_utterances += 1
                        if event["transcript"] != expected:
                            self.traffic.wrong.append("live")
                        return
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender
        self.traffic.failures.append("live: closed before completed")

    async def _live_loop(self, index: int, until: float) -> None:
        n = 0
        while time.monotonic() < until:
            pcm, expected = self.live_pcm[(index + n) % len(self.live_pcm)]
            n += 1
            self.traffic.inflight += 1
            try:
                await asyncio.wait_for(self._live_once(pcm, expected), 300)
            except Exception as exc:
                self.traffic.failures.append(f"live: {type(exc).__name__}: {exc}")
            finally:
                self.traffic.inflight -= 1

    async def run_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        loops = [self._upload_loop(i, until) for i in range(self.upload_clients)]
        loops += [self._live_loop(i, until) for i in range(self.live_clients)]
        await asyncio.gather(*loops)


async def sample(url: str, server_pid: int | None) -> dict[str, Any]:
    import httpx

    await asyncio.sleep(2.0)  # let closed connections and finished tasks go away
    async with httpx.AsyncClient(timeout=30) as client:
        worker_pid = (await client.get(f"{url}/health/ready")).json().get("worker_pid")
    metrics = await asyncio.to_thread(scrape_metrics, url)
    out: dict[str, Any] = {
        "t": round(time.time(), 1),
        "tasks": sample_value(metrics, "specwhisper_asyncio_tasks"),
        "realtime_sessions": sample_value(metrics, "specwhisper_realtime_sessions"),
        "dev_shm_entries": shm_entries(),
    }
    await asyncio.sleep(0.5)
    if server_pid:
        out["web"] = proc_stats(server_pid)
    if worker_pid:
        out["worker"] = proc_stats(worker_pid)
    return out


def verdict(baseline: dict[str, Any], final: dict[str, Any], traffic: Traffic, tracebacks: int) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for proc in ("web", "worker"):
        if proc in baseline and proc in final:
            b, f = baseline[proc], final[proc]
            growth = (f["rss_kb"] - b["rss_kb"]) / b["rss_kb"]
            checks[f"{proc}_rss_growth"] = {"value": round(growth, 4), "ok": growth < RSS_GROWTH_LIMIT}
            checks[f"{proc}_fds"] = {"value": [b["fds"], f["fds"]], "ok": f["fds"] <= b["fds"] + FD_SLACK}
            checks[f"{proc}_threads"] = {
                "value": [b["threads"], f["threads"]],
                "ok": f["threads"] <= b["threads"] + THREAD_SLACK,
            }
            checks[f"{proc}_shm"] = {"value": [b["shm"], f["shm"]], "ok": f["shm"] <= b["shm"]}
    if baseline.get("tasks") is not None and final.get("tasks") is not None:
        checks["asyncio_tasks"] = {
            "value": [baseline["tasks"], final["tasks"]],
            "ok": final["tasks"] <= baseline["tasks"],
        }
    checks["realtime_sessions_released"] = {
        "value": final.get("realtime_sessions"),
        "ok": not final.get("realtime_sessions"),
    }
    checks["answers_correct"] = {"value": len(traffic.wrong), "ok": not traffic.wrong}
    checks["no_failures"] = {"value": traffic.failures[:5], "ok": not traffic.failures}
    checks["no_5xx"] = {
        "value": {k: v for k, v in traffic.statuses.items() if k.startswith("5")},
        "ok": not any(k.startswith("5") for k in traffic.statuses),
    }
    checks["server_log_tracebacks"] = {"value": tracebacks, "ok": tracebacks == 0}
    return checks


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    url, server_pid = args.url, args.server_pid
    server: ServerProcess | None = None
    log_path = args.log or Path(tempfile.mkdtemp(prefix="specwhisper-soak-")) / "server.log"
    if url is None:
        server = ServerProcess(log=log_path).launch()
        url, server_pid = server.url, server.proc.pid if server.proc else None
    url = url.rstrip("/")
    try:
        if server is not None:
            await asyncio.to_thread(server.wait_ready, 300)
        clips = clips_from_args(args, max_seconds=12.0)
        runner = Soak(url, clips, args.uploads, args.live, args.speedup)
        await runner.prepare()
        total = args.minutes * 60
        warmup = args.warmup_minutes * 60 if args.warmup_minutes is not None else min(180.0, 0.2 * total)
        started = time.monotonic()
        await runner.run_for(warmup)
        baseline = await sample(url, server_pid)
        timeline = [baseline]
        remaining = total - (time.monotonic() - started)
        while remaining > 0:
            await runner.run_for(min(args.interval, remaining))
            timeline.append(await sample(url, server_pid))
            remaining = total - (time.monotonic() - started)
        final = timeline[-1]
        tracebacks = log_path.read_text(errors="replace").count("Traceback") if log_path.exists() else 0
        checks = verdict(baseline, final, runner.traffic, tracebacks)
        ready = httpx.get(f"{url}/health/ready", timeout=10).json()
        return {
            "url": url,
            "minutes": args.minutes,
            "warmup_s": round(warmup, 1),
            "uploads": runner.traffic.uploads,
            "upload_statuses": dict(runner.traffic.statuses),
            "live_utterances": runner.traffic.live_utterances,
            "worker_restarts": ready.get("worker_restarts"),
            "baseline": baseline,
            "final": final,
            "peak_rss_kb": {
                p: max(s[p]["rss_kb"] for s in timeline if p in s) for p in ("web", "worker") if p in baseline
            },
            "samples": len(timeline),
            "checks": checks,
            "passed": all(c["ok"] for c in checks.values()),
            "server_log": str(log_path),
        }
    finally:
        if server is not None:
            server.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=20.0, help="total traffic time")
    parser.add_argument("--warmup-minutes", type=float, help="before the baseline (default: 20%%, at most 3 min)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--uploads", type=int, default=2, help="concurrent upload clients")
    parser.add_argument("--live", type=int, default=1, help="concurrent WebSocket clients")
    parser.add_argument("--speedup", type=float, default=2.0, help="live audio sent this many times real time")
    add_clip_arguments(parser)
    add_server_arguments(parser, "for RSS/fd sampling with --url")


def run_cli(args: argparse.Namespace) -> int:
    return print_verdict(asyncio.run(soak(args)), args.json)
