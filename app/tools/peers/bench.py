"""`python -m app peerbench`: SpecWhisper against the servers people run instead, in one run, side by side.

Every server is started with the same thread count on the same Whisper weights (SpecWhisper on its store
model, each peer on the CTranslate2 files that model was converted from) and gets the same load from the
same generator (app/tools/peers/load.py):
- uploads: at each concurrency, `requests` uploads of the same English clips (the form the official SDK sends);
- live: at each session count, sessions streaming the same clips in real time into the server's own live
  protocol (SpecWhisper's Realtime API, WhisperLive's WebSocket protocol); a server without one is left out.
At each level the servers take turns, the lead rotating, so a slow spell of the machine hits them alike. Each
server is warmed up first (its first requests load models and kernels). Memory is each server's process-tree
peak RSS per level and over the run.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.tools.loadtest import Clip
from app.tools.peers import load
from app.tools.peers.servers import BenchServer, build
from app.tools.realtimebench import english_clips


def bench_clips(manifest: Path, count: int) -> list[Clip]:
    """The first `count` English clips of the manifest's short subset between 3 and 15 s: for uploads and live."""
    picked = english_clips(manifest, count)
    if not picked:
        raise LookupError(f"{manifest}: no English clip of 3..15 s in the short subset")
    return [Clip(c.id, c.read_bytes(), c.duration_s, expected=c.text, language="en") for c in picked]


def _live_clips(clips: list[Clip]) -> list[tuple[Any, str]]:
    from app.api.audio import decode_audio

    return [(decode_audio(c.data), c.expected) for c in clips]


def _machine(threads: int) -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    ) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "threads_per_server": threads,
        "load_1min_before": os.getloadavg()[0],
    }


def _turns(servers: list[BenchServer], level: int) -> list[BenchServer]:
    """The servers in turn, the lead rotating with the level."""
    k = level % len(servers)
    return servers[k:] + servers[:k]


def run_peer_bench(
    manifest: Path,
    peers: list[str],
    clients: list[int],
    sessions: list[int],
    *,
    n_clips: int = 8,
    requests: int = 32,
    live_clips: int = 4,
    threads: int = 2,
    model: str = "whisper-base",
    chunk_ms: int = 100,
    silence_ms: int = 500,
    peers_dir: Path | None = None,
    settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    machine = _machine(threads)  # the load before the run
    clips = bench_clips(manifest, n_clips)
    live = _live_clips(clips[:live_clips])
    servers = build(peers, threads, model, peers_dir, settings)
    log_dir = Path(tempfile.mkdtemp(prefix="specwhisper-peerbench-"))
    results: dict[str, dict[str, Any]] = {
        s.name: {"setup": s.setup, "uploads": {}, "live": {}, "log": str(log_dir / f"{s.name}.log")} for s in servers
    }
    live_servers = [s for s in servers if s.live is not None]
    steps = len(clients) * len(servers) + len(sessions) * len(live_servers)
    try:
        for server in servers:
            server.launch(log_dir)
        for server in servers:
            server.wait_ready()
            # warm-up: the first requests load the model (peers load it on first use) and touch every kernel
            asyncio.run(load.uploads(server, clips, 1, min(2, len(clips))))
            if server.live is not None:
                asyncio.run(load.sessions(server, live[:1], 1, chunk_ms / 1000, silence_ms))
        with tqdm(total=steps, desc="peerbench", unit="level") as bar:
            for i, concurrency in enumerate(clients):
                for server in _turns(servers, i):
                    bar.set_postfix_str(f"{server.name}, {concurrency} upload clients")
                    assert server.rss is not None
                    server.rss.take()
                    level = asyncio.run(load.uploads(server, clips, concurrency, requests))
                    level["peak_rss_mb"] = server.rss.take()
                    results[server.name]["uploads"][str(concurrency)] = level
                    bar.update()
            for i, count in enumerate(sessions):
                for server in _turns(live_servers, i):
                    bar.set_postfix_str(f"{server.name}, {count} live sessions")
                    assert server.rss is not None
                    server.rss.take()
                    level = asyncio.run(load.sessions(server, live, count, chunk_ms / 1000, silence_ms))
                    level["peak_rss_mb"] = server.rss.take()
                    results[server.name]["live"][str(count)] = level
                    bar.update()
    finally:
        for server in servers:
            server.stop()
            if server.rss is not None:
                results[server.name]["peak_rss_mb"] = round(server.rss.overall, 1)
    report = {
        "machine": machine,
        "model": model,
        "clips": [c.name for c in clips],
        "audio_s": round(sum(c.seconds for c in clips), 2),
        "requests_per_level": requests,
        "live": {"clips": len(live), "chunk_ms": chunk_ms, "silence_duration_ms": silence_ms},
        "servers": results,
    }
    report["targets"] = targets(report)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as ratios of this run (SpecWhisper against the best peer at that level)."""
    servers = report["servers"]
    ours = servers.get("specwhisper", {})
    peers = {name: r for name, r in servers.items() if name != "specwhisper"}
    out: dict[str, Any] = {}
    levels = sorted(int(c) for c in ours.get("uploads", {}))
    for c in levels[:1] + levels[-1:]:
        best = max(
            (p["uploads"][str(c)]["throughput_audio_s_per_s"] for p in peers.values() if str(c) in p["uploads"]),
            default=None,
        )
        out[f"uploads_throughput_vs_best_peer_at_{c}"] = {
            "ratio": _ratio(ours["uploads"][str(c)]["throughput_audio_s_per_s"], best),
            "target": ">= 1.5" if c == levels[0] else ">= 1.0",
        }
    for n in sorted(int(k) for k in ours.get("live", {})):
        for name, peer in peers.items():
            if str(n) in peer.get("live", {}):
                out[f"live_p95_final_vs_{name}_at_{n}"] = {
                    "ratio": _ratio(ours["live"][str(n)]["p95_ms"], peer["live"][str(n)]["p95_ms"]),
                    "target": "<= 0.5" if n == 1 else "< 1.0",
                }
    for mode in ("uploads", "live"):
        for level, ours_level in ours.get(mode, {}).items():
            others = [p[mode][level]["wer"] for p in peers.values() if level in p.get(mode, {})]
            others = [w for w in others if w is not None]
            if others and ours_level["wer"] is not None:
                out[f"{mode}_wer_vs_best_peer_at_{level}"] = {
                    "ours": ours_level["wer"],
                    "best_peer": min(others),
                    "met": ours_level["wer"] <= min(others),
                }
    return out


def table(report: dict[str, Any]) -> str:
    """Markdown tables: one per mode, a row per server and level."""
    lines: list[str] = []
    for mode, unit in (("uploads", "clients"), ("live", "sessions")):
        rows = [
            (name, level, r)
            for name, server in report["servers"].items()
            for level, r in sorted(server.get(mode, {}).items(), key=lambda kv: int(kv[0]))
        ]
        if not rows:
            continue
        if mode == "uploads":
            lines += [f"| server | {unit} | audio s / s | p50 ms | p95 ms | p99 ms | WER | errors | peak RSS MB |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
            lines += [
                f"| {name} | {level} | {r['throughput_audio_s_per_s']} | {r['p50_ms']} | {r['p95_ms']} | {r['p99_ms']}"
                f" | {_pct(r['wer'])} | {r['errors']} | {r['peak_rss_mb']} |"
                for name, level, r in sorted(rows, key=lambda t: (int(t[1]), t[0]))
            ]
        else:
            head = (
                f"| server | {unit} | final p50 ms | final p95 ms | first partial p50 / p95 ms | WER | missing finals"
            )
            lines += [head + " | peak RSS MB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            lines += [
                f"| {name} | {level} | {r['p50_ms']} | {r['p95_ms']} | {r['first_partial_p50_ms']} / "
                f"{r['first_partial_p95_ms']} | {_pct(r['wer'])} | {r['missing_finals']} of {r['utterances']}"
                f" | {r['peak_rss_mb']} |"
                for name, level, r in sorted(rows, key=lambda t: (int(t[1]), t[0]))
            ]
        lines.append("")
    return "\n".join(lines)


def _pct(wer: float | None) -> str:
    return "-" if wer is None else f"{wer * 100:.2f}%"


def plot(report: dict[str, Any], path: Path) -> None:
    """One figure, a panel per measure: upload throughput and p95 latency by clients, live p95 by sessions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("uploads", "throughput_audio_s_per_s", "uploads: audio s per wall s", "concurrent clients"),
        ("uploads", "p95_ms", "uploads: p95 latency (ms)", "concurrent clients"),
        ("live", "p95_ms", "live: p95 end of utterance to final (ms)", "concurrent sessions"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (mode, key, title, xlabel) in zip(axes, panels, strict=True):
        for name, server in report["servers"].items():
            points = sorted((int(k), v[key]) for k, v in server.get(mode, {}).items() if v.get(key) is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']}, {report['machine']['threads_per_server']} threads per server, "
                 f"{report['machine']['cpu']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
