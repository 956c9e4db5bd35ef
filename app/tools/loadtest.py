"""`python -m app loadtest`: N concurrent clients against a running server, every answer checked.

Each request carries its own `X-Request-Id`; its response must echo that id and, for a 200, the
text the same clip got when it was sent alone before the load (greedy decoding is deterministic and
batched rows equal single ones). A 429 must carry `Retry-After` (the client then waits that long).
Lost answers (transport errors), duplicated or mismatched ids, wrong texts and 5xx fail the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.tools.manifest import default_manifest, read_manifest, select, shortest

if TYPE_CHECKING:
    import httpx  # a dev/test dependency: imported where used


@dataclass(frozen=True)
class Clip:
    name: str
    data: bytes
    seconds: float
    expected: str = ""
    language: str = "en"


@dataclass
class Outcome:
    request_id: str
    clip: str
    status: int  # 0: no answer (transport error)
    latency_s: float
    echoed_id: str | None = None
    correct: bool | None = None  # 200 only: text == expected
    retry_after: str | None = None
    error: str | None = None


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def summary(self, clips: dict[str, Clip]) -> dict[str, Any]:
        statuses = Counter(str(o.status) for o in self.outcomes)
        ok = [o for o in self.outcomes if o.status == 200]
        limited = [o for o in self.outcomes if o.status == 429]
        answered = Counter(o.request_id for o in self.outcomes if o.status)
        sent = Counter(self.sent)

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)

        latencies = [o.latency_s for o in ok]
        report = {
            "requests": len(self.sent),
            "elapsed_s": round(self.elapsed_s, 2),
            "status_counts": dict(sorted(statuses.items())),
            "ok": len(ok),
            "wrong_text": sum(1 for o in ok if not o.correct),
            "server_errors_5xx": sum(1 for o in self.outcomes if o.status >= 500),
            "unexpected_status": sum(1 for o in self.outcomes if o.status not in (0, 200, 429) and o.status < 500),
            "lost": sum(1 for o in self.outcomes if o.status == 0) + sum((sent - answered).values()),
            "duplicated": sum(n - 1 for n in answered.values() if n > 1) + sum(1 for n in sent.values() if n > 1),
            "id_mismatch": sum(1 for o in self.outcomes if o.status and o.echoed_id != o.request_id),
            "rate_limited": len(limited),
            "rate_limited_without_retry_after": sum(1 for o in limited if not (o.retry_after or "").isdigit()),
            "latency_ms_ok": {
                "p50": pct(latencies, 0.50),
                "p90": pct(latencies, 0.90),
                "p99": pct(latencies, 0.99),
                "max": pct(latencies, 1.0),
                "mean": round(statistics.fmean(latencies) * 1000, 1) if latencies else None,
            },
            "latency_ms_429": {"p50": pct([o.latency_s for o in limited], 0.5)},
            "throughput_rps": round(len(ok) / self.elapsed_s, 3) if self.elapsed_s else 0.0,
            "audio_seconds_per_second": round(sum(clips[o.clip].seconds for o in ok) / self.elapsed_s, 3)
            if self.elapsed_s
            else 0.0,
            "transport_errors": sorted({o.error for o in self.outcomes if o.error})[:5],
        }
        report["passed"] = not (
            report["wrong_text"]
            or report["server_errors_5xx"]
            or report["unexpected_status"]
            or report["lost"]
            or report["duplicated"]
            or report["id_mismatch"]
            or report["rate_limited_without_retry_after"]
        )
        return report


def _headers(api_key: str | None, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def transcribe(
    client: httpx.AsyncClient, url: str, clip: Clip, request_id: str, api_key: str | None = None
) -> httpx.Response:
    return await client.post(
        f"{url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": (clip.name.replace("/", "_"), clip.data, "audio/wav")},
        headers=_headers(api_key, request_id),
    )


async def reference_texts(url: str, clips: list[Clip], api_key: str | None = None, timeout: float = 300) -> list[Clip]:
    """Each clip's text sent alone, before the load: what every loaded answer must equal."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        for clip in clips:
            r = await transcribe(client, url, clip, f"ref-{uuid.uuid4().hex}", api_key)
            r.raise_for_status()
            out.append(Clip(clip.name, clip.data, clip.seconds, r.json()["text"]))
    return out


async def run_load(
    url: str,
    clips: list[Clip],
    clients: int = 32,
    duration_s: float = 60.0,
    api_key: str | None = None,
    timeout: float = 300.0,
) -> LoadReport:
    """`clients` loops send clips round-robin until `duration_s` has passed; the last requests are awaited."""
    import httpx

    report = LoadReport()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < deadline:
            clip = clips[(index + n) % len(clips)]
            request_id = f"load-{index}-{n}-{uuid.uuid4().hex[:8]}"
            n += 1
            report.sent.append(request_id)
            started = time.perf_counter()
            try:
                r = await transcribe(client, url, clip, request_id, api_key)
            except httpx.HTTPError as exc:
                report.outcomes.append(
                    Outcome(request_id, clip.name, 0, time.perf_counter() - started, error=type(exc).__name__)
                )
                continue
            outcome = Outcome(request_id, clip.name, r.status_code, time.perf_counter() - started)
            outcome.echoed_id = r.headers.get("x-request-id")
            if r.status_code == 200:
                outcome.correct = r.json().get("text") == clip.expected
            elif r.status_code == 429:
                outcome.retry_after = r.headers.get("retry-after")
            report.outcomes.append(outcome)
            if r.status_code in (429, 503):
                retry = outcome.retry_after or ""
                wait = float(retry) if retry.isdigit() else 1.0
                await asyncio.sleep(max(0.0, min(wait, deadline - time.monotonic())))

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
    report.elapsed_s = time.monotonic() - started
    return report


def load_clips(manifest: Path, count: int = 4, max_seconds: float = 6.0) -> list[Clip]:
    """The `count` shortest English clips of 1..`max_seconds` s from a benchdata manifest."""
    picked = shortest(select(read_manifest(manifest), languages={"en"}, min_seconds=1, max_seconds=max_seconds), count)
    if not picked:
        raise SystemExit(f"no English clip of 1..{max_seconds:g} s in {manifest}")
    return [Clip(c.id, c.read_bytes(), c.duration_s) for c in picked]


def add_clip_arguments(parser: argparse.ArgumentParser) -> None:
    """--manifest and --clips: which clips `clips_from_args` takes."""
    parser.add_argument(
        "--manifest", type=Path, help="benchdata manifest.jsonl (default: $SPECWHISPER_BENCHDATA, else ../shared)"
    )
    parser.add_argument("--clips", type=int, default=4, help="how many short clips to rotate through")


def clips_from_args(args: argparse.Namespace, max_seconds: float = 6.0) -> list[Clip]:
    return load_clips(args.manifest or default_manifest(), args.clips, max_seconds=max_seconds)


async def loadtest(
    url: str, clips: list[Clip], clients: int, duration_s: float, api_key: str | None = None
) -> dict[str, Any]:
    clips = await reference_texts(url, clips, api_key)
    report = await run_load(url, clips, clients, duration_s, api_key)
    summary = report.summary({c.name: c for c in clips})
    summary.update(url=url, clients=clients, duration_s=duration_s, clips=[c.name for c in clips])
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (last requests are awaited)")
    add_clip_arguments(parser)
    parser.add_argument("--api-key", default=os.environ.get("SPECWHISPER_LOADTEST_KEY"), help="Bearer key")
    parser.add_argument("--json", type=Path, help="also write the report here")


def run_cli(args: argparse.Namespace) -> int:
    clips = clips_from_args(args)
    summary = asyncio.run(loadtest(args.url.rstrip("/"), clips, args.clients, args.duration, args.api_key))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if summary["passed"] else 1
