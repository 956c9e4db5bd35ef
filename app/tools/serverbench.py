"""Speculation modes under load, through the real server: throughput and latency at each concurrency.

For each mode (`adaptive`, `always`, `never`) a server is started with that `speculation` setting;
for each concurrency c, c clients keep uploads in flight (the `limit` shortest clips of the manifest
in the chosen languages, English by default, up to 30 s unless told otherwise, round robin) until
`requests_per_client * c` answers are in. The servers run side by side and the modes take turns,
`rounds` times per level, each mode leading one round in turn; each level reports the round with
the median throughput and the range over the rounds. Every answer's
text is checked against the first answer for the same clip (all modes decode greedily: the texts
must be identical).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from app.tools.bench import select_clips
from app.tools.loadtest import Clip
from app.tools.manifest import shortest
from app.tools.process import ServerProcess

MODES = ("adaptive", "always", "never")


async def drive(concurrency: int, total: int, request: Callable[[int], Awaitable[None]]) -> float:
    """`request(0)` .. `request(total - 1)` with `concurrency` in flight, each client taking the next when its
    last is done; returns the wall time (s)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)

    async def client() -> None:
        while not queue.empty():
            await request(queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _level(url: str, clips: list[Clip], concurrency: int, total: int) -> dict[str, Any]:
    """`total` uploads with `concurrency` in flight; latencies, throughput, texts and modes used."""
    latencies: list[float] = []
    texts: dict[str, str] = {}
    speculative = 0
    async with httpx.AsyncClient(timeout=600) as client:

        async def upload(i: int) -> None:
            nonlocal speculative
            clip = clips[i % len(clips)]
            started = time.perf_counter()
            r = await client.post(
                f"{url}/v1/audio/transcriptions",
                data={"model": "whisper-1", "language": clip.language},
                files={"file": ("clip.wav", clip.data)},
            )
            r.raise_for_status()
            latencies.append(time.perf_counter() - started)
            body = r.json()
            texts[clip.name] = body["text"]
            speculative += bool(body["metrics"]["speculative"])

        wall = await drive(concurrency, total, upload)
    audio = sum(clips[i % len(clips)].seconds for i in range(total))
    return {
        "concurrency": concurrency,
        "requests": total,
        "wall_s": round(wall, 3),
        "throughput_audio_s_per_s": round(audio / wall, 3),
        "p50_latency_s": round(statistics.median(latencies), 3),
        "p90_latency_s": round(statistics.quantiles(latencies, n=10)[-1], 3) if len(latencies) > 1 else None,
        "speculative_fraction": round(speculative / total, 3),
        "texts": texts,
    }


def _median(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (its own latencies and mode fractions kept together),
    and the lowest and highest throughput of the rounds: the run-to-run spread."""
    ranked = sorted(levels, key=lambda level: level["throughput_audio_s_per_s"])
    spread = [ranked[0]["throughput_audio_s_per_s"], ranked[-1]["throughput_audio_s_per_s"]]
    return {**ranked[len(ranked) // 2], "rounds": len(levels), "throughput_range": spread}


def bench_clips(
    manifest: Path, limit: int, languages: set[str], subset: str | None = None, max_seconds: float | None = None
) -> list[Clip]:
    """The `limit` shortest clips of the manifest that `select_clips` takes for these filters."""
    picked = shortest(select_clips(manifest, languages, None, max_seconds, subset), limit)
    return [Clip(c.id, c.read_bytes(), c.duration_s, language=c.language) for c in picked]


def run_server_bench(
    manifest: Path,
    concurrency: Sequence[int],
    modes: Sequence[str] = MODES,
    limit: int = 8,
    requests_per_client: int = 2,
    rounds: int = 3,
    env: dict[str, str] | None = None,
    languages: set[str] | None = None,
    subset: str | None = None,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """The report: per mode and concurrency, throughput and latency; ratios of adaptive to the best fixed mode."""
    clips = bench_clips(manifest, limit, languages or {"en"}, subset, max_seconds)
    reference: dict[str, str] = {}  # the first answer for each clip
    report: dict[str, Any] = {
        "clips": len(clips),
        "clip_ids": [c.name for c in clips],
        "modes": {m: [] for m in modes},
        "engines": {},  # per mode, what its server runs (`Engine.describe()`, from /health/ready)
        "identical_texts": True,
        "texts": reference,
    }
    # All servers run side by side and the modes take turns at each level, so that a change in the
    # machine's load hits every mode alike.
    settings = {"SPECWHISPER_BATCH_WINDOW_MS": "20", **(env or {})}
    servers = {m: ServerProcess({**settings, "SPECWHISPER_SPECULATION": m}).launch() for m in modes}
    try:
        for mode, server in servers.items():
            server.wait_ready()
            report["engines"][mode] = httpx.get(f"{server.url}/health/ready", timeout=30).json()["engine"]
            asyncio.run(_level(server.url, clips[:2], 1, 2))  # warm-up
        for c in concurrency:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for r in range(rounds):
                order = list(servers.items())
                for mode, server in order[r % len(order) :] + order[: r % len(order)]:  # each mode leads a round
                    level = asyncio.run(_level(server.url, clips, c, max(len(clips), requests_per_client * c)))
                    for clip_id, text in level.pop("texts").items():
                        if reference.setdefault(clip_id, text) != text:
                            report["identical_texts"] = False
                    runs[mode].append(level)
            for mode, levels in runs.items():
                report["modes"][mode].append(_median(levels))
    finally:
        for server in servers.values():
            server.stop()
    if {"adaptive", "always", "never"} <= set(modes):
        ratios = []
        for a, s, p in zip(
            report["modes"]["adaptive"], report["modes"]["always"], report["modes"]["never"], strict=True
        ):
            best = max(s["throughput_audio_s_per_s"], p["throughput_audio_s_per_s"])
            ratios.append(
                {
                    "concurrency": a["concurrency"],
                    "adaptive_vs_best_fixed": round(a["throughput_audio_s_per_s"] / best, 3),
                    "speculative_vs_plain": round(s["throughput_audio_s_per_s"] / p["throughput_audio_s_per_s"], 3),
                }
            )
        report["ratios"] = ratios
    return report
