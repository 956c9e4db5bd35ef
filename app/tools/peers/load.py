"""The same client load for every server: uploads at a concurrency, and live sessions at a count."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from app.tools.bench import error_rate
from app.tools.loadtest import Clip
from app.tools.peers import live
from app.tools.peers.servers import BenchServer
from app.tools.realtimebench import LEAD_S, TAIL_S, ClipRun, nearest_rank
from app.tools.serverbench import drive


def _ms(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of `values` (seconds), in ms."""
    if not values:
        return None
    value = nearest_rank(values, q)
    assert value is not None
    return round(value * 1000, 1)


async def uploads(server: BenchServer, clips: list[Clip], concurrency: int, total: int) -> dict[str, Any]:
    """`total` uploads of `clips` in turn with `concurrency` in flight, each the multipart form the official SDK
    sends (`file`, `model`, `language`): throughput in audio seconds per wall second, latency, errors, WER."""
    latencies: list[float] = []
    answers: list[tuple[str, str, str]] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def upload(i: int) -> None:
            clip = clips[i % len(clips)]
            started = time.perf_counter()
            try:
                r = await client.post(
                    f"{server.upload_url}/v1/audio/transcriptions",
                    data={"model": "whisper-1", "language": clip.language},
                    files={"file": (f"{clip.name}.wav", clip.data, "audio/wav")},
                )
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                return
            latencies.append(time.perf_counter() - started)
            answers.append((clip.expected, r.json()["text"], clip.language))

        wall = await drive(concurrency, total, upload)
    audio = sum(clips[i % len(clips)].seconds for i in range(total))
    return {
        "concurrency": concurrency,
        "requests": total,
        "wall_s": round(wall, 2),
        "throughput_audio_s_per_s": round(audio / wall, 2),
        "p50_ms": _ms(latencies, 0.5),
        "p95_ms": _ms(latencies, 0.95),
        "p99_ms": _ms(latencies, 0.99),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wer": round(error_rate(answers), 4) if answers else None,
    }


async def sessions(
    server: BenchServer, clips: live.Clips, count: int, step_s: float, silence_ms: int
) -> dict[str, Any]:
    """`count` live sessions, started spread over one clip's period (independent callers), each streaming every
    clip: end of utterance to final (p50/p95), start of speech to first partial, WER of the finals."""
    period = LEAD_S + TAIL_S + sum(a.size for a, _ in clips) / len(clips) / live.SAMPLE_RATE

    async def one(i: int) -> list[ClipRun]:
        delay = i * period / count
        if server.live == "openai-realtime":
            return await live.openai_realtime(server.upload_url, clips, delay, step_s, silence_ms)
        assert server.live == "whisperlive" and server.live_url
        return await live.whisperlive(server.live_url, clips, delay, step_s)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    wall = time.perf_counter() - started
    runs = [run for result in results if isinstance(result, list) for run in result]
    streamed = len(runs) * LEAD_S + len(runs) * TAIL_S + sum(r.end_ms - r.start_ms for r in runs) / 1000
    failed = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    finals = [r.completed - r.speech_end for r in runs if r.completed is not None]
    firsts = [r.first_delta - r.speech_start for r in runs if r.first_delta is not None]
    return {
        "sessions": count,
        "utterances": len(runs),
        # audio streamed per wall second: real time per session, less while the last finals are awaited
        "throughput_audio_s_per_s": round(streamed / wall, 2),
        "p50_ms": _ms(finals, 0.5),  # end of utterance to its final
        "p95_ms": _ms(finals, 0.95),
        "first_partial_p50_ms": _ms(firsts, 0.5),
        "first_partial_p95_ms": _ms(firsts, 0.95),
        "missing_finals": sum(r.completed is None for r in runs),
        "errors": len(failed) + sum(r.completed is None for r in runs),
        "error_samples": failed[:3],
        "wer": round(error_rate([(r.reference, " ".join(r.texts), "en") for r in runs]), 4) if runs else None,
    }
