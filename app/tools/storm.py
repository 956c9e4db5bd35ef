"""`python -m app storm`: long audio in small files against one server, with the costs it must stay within.

What a stranger can send in small files: an hour of silence is a 177-kB FLAC file, an hour of speech an
~8-MB Opus file. The command starts a server (or takes `--url` and `--server-pid`) and measures:

1. idle: a short clip's upload latency (the median of 5), the server's resident memory;
2. one long silent upload alone: how much it raises the web process's peak memory;
3. the storm: `--silent` long silent uploads and `--speech` long speech uploads at once, while a client keeps
   uploading the short clip and a live session keeps streaming; every answer's status, the short clip's
   answers and latencies, the live session's finals, the whole server's peak memory (web + worker), restarts.
   Each short answer's time is split by where it went (`where_it_waited`, from the answer's own `metrics`), and
   the answers over `--max-slowdown` times the idle latency are summed up by part.

Prints one JSON report with a verdict against the targets (`--max-memory-mb`, `--max-one-mb`, `--max-slowdown`).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from app.tools.process import ServerProcess, add_server_arguments, print_verdict
from app.tools.usage import PeakSampler, cpu_s

SR = 16000
SHORT_CLIP = "whisper/jfk"


def encoded(samples: np.ndarray, container: str = "FLAC", codec: str = "PCM_16") -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, samples, SR, format=container, subtype=codec)
    return out.getvalue()


def long_speech(manifest: Path, seconds: float, pause_s: float = 0.5) -> np.ndarray:
    """Benchdata's English clips, one after another with a pause of `pause_s`, repeated to `seconds`."""
    from app.api.audio import load_audio
    from app.tools.manifest import read_manifest

    clips = [c for c in read_manifest(manifest) if c.language == "en"][:20]
    gap = np.zeros(int(pause_s * SR), np.float32)
    once = np.concatenate([x for c in clips for x in (load_audio(c.audio), gap)])
    return np.resize(once, int(seconds * SR))


class Answer(NamedTuple):
    status: int
    seconds: float  # as the client saw it
    text: str
    metrics: dict[str, Any]  # the answer's `metrics` (json): queue_ms, encode_ms, decode_ms, total_ms, ...


def where_it_waited(answer: Answer) -> dict[str, float]:
    """An answer's time split, in s: before the serving layer (HTTP, the multipart form), in the serving layer
    before and after its job (admission, the audio budget, reading the upload, the reply), in the worker's
    queue, and the worker's encoder and decoder (those of the batch that ran it; past the queue, the wait for the
    next encoder layer or decoder pass of a batch it runs inside counts as serving)."""
    m = answer.metrics
    total, queue = m.get("total_ms", 0.0) / 1000, m.get("queue_ms", 0.0) / 1000
    encoder, decoder = m.get("encode_ms", 0.0) / 1000, m.get("decode_ms", 0.0) / 1000
    return {
        "http": answer.seconds - total,
        "serving": max(total - queue - encoder - decoder, 0.0),
        "queue": queue,
        "encoder": encoder,
        "decoder": decoder,
    }


SPLIT_PARTS = ("http", "serving", "queue", "encoder", "decoder")


def beside_finals(answers: list[tuple[float, float]], finals: list[float]) -> dict[str, Any]:
    """Short answers, each (when it came, its latency), split by whether a live final came while it was in
    flight (it then waited for that final in the worker, finals going first), each part's count, median and
    largest latency (s)."""

    def with_final(end: float, latency: float) -> bool:
        return any(end - latency <= t <= end for t in finals)

    parts: dict[str, list[float]] = {"with_final": [], "without": []}
    for end, latency in answers:
        parts["with_final" if with_final(end, latency) else "without"].append(latency)
    return {
        name: {
            "answers": len(v),
            "median": round(statistics.median(v), 3) if v else None,
            "max": round(max(v), 3) if v else None,
        }
        for name, v in parts.items()
    }


def slow_parts(splits: list[dict[str, float]]) -> dict[str, Any]:
    """How many answers, and each part's mean and largest, in s."""
    return {
        "answers": len(splits),
        **{
            part: {
                "mean": round(statistics.fmean(x[part] for x in splits), 2),
                "max": round(max(x[part] for x in splits), 2),
            }
            for part in SPLIT_PARTS
            if splits
        },
    }


@dataclass
class Storm:
    url: str
    short: bytes
    short_text: str = ""
    statuses: Counter[str] = field(default_factory=Counter)
    short_answers: list[tuple[float, Answer]] = field(default_factory=list)  # the 200s, each with when it came
    short_wrong: int = 0
    short_statuses: Counter[str] = field(default_factory=Counter)
    live_finals: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    async def upload(self, data: bytes, name: str, **fields: str) -> Answer:
        import httpx

        started = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=1800) as client:
                r = await client.post(
                    f"{self.url}/v1/audio/transcriptions",
                    data={"model": "whisper-1", **fields},
                    files={"file": (name, data, "application/octet-stream")},
                )
        except httpx.HTTPError as exc:
            self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
            return Answer(0, time.perf_counter() - started, "", {})
        seconds = time.perf_counter() - started
        if r.status_code != 200:
            return Answer(r.status_code, seconds, r.text[:200], {})
        body = r.json()
        return Answer(r.status_code, seconds, body.get("text", ""), body.get("metrics", {}))

    async def idle_latency(self, runs: int = 5) -> float:
        """The median latency of `runs` short uploads sent one after another (s)."""
        return statistics.median([(await self.upload(self.short, "short.wav")).seconds for _ in range(runs)])

    async def short_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            answer = await self.upload(self.short, "short.wav")
            self.short_statuses[str(answer.status)] += 1
            if answer.status == 200:
                self.short_answers.append((round(time.monotonic(), 1), answer))
                self.short_wrong += answer.text != self.short_text
            await asyncio.sleep(0.2)

    async def live_loop(self, speech: np.ndarray, stop: asyncio.Event) -> None:
        """One session, server VAD, streaming speech in real time (100-ms chunks) until `stop`: the time of each
        final."""
        import base64

        from websockets.asyncio.client import connect

        pcm = (np.clip(speech, -1, 32767 / 32768) * 32768).astype("<i2")
        step = SR // 10
        ws_url = self.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        async with connect(ws_url, max_size=None) as ws:
            session = {"input_audio_format": "pcm16", "input_audio_sample_rate": 16000}
            await ws.send(json.dumps({"type": "transcription_session.update", "session": session}))

            async def send() -> None:
                position = 0
                while not stop.is_set():
                    chunk = pcm[position % pcm.size : position % pcm.size + step]
                    position += step
                    audio = base64.b64encode(chunk.tobytes()).decode()
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                    await asyncio.sleep(0.1)

            sender = asyncio.create_task(send())
            try:
                while not stop.is_set():
                    try:
                        event = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                    except TimeoutError:
                        continue
                    if event["type"].endswith("transcription.completed"):
                        self.live_finals.append(time.monotonic())
                    elif event["type"] == "error" or event["type"].endswith("transcription.failed"):
                        self.failures.append(f"live: {event}")
            finally:
                sender.cancel()


async def storm(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from app.tools.manifest import default_manifest, read_manifest

    manifest = args.manifest or default_manifest()
    clips = {c.id: c for c in read_manifest(manifest)}
    short = Path(clips[SHORT_CLIP].audio).read_bytes()
    seconds = args.minutes * 60
    silent = encoded(np.zeros(int(seconds * SR), np.int16))  # FLAC: ~3 kB a minute
    speech_audio = long_speech(manifest, 60 * (args.speech_minutes or args.minutes))
    # The live speaker pauses a second between utterances, as a voice agent's user waits for its answer (with
    # half a second, the server VAD's 500 ms, turns ran together for up to 30 s).
    live_audio = long_speech(manifest, 600, pause_s=1.0)
    speech = encoded(speech_audio, "OGG", "OPUS")  # a voice note's format: an hour fits the 25-MB limit
    server: ServerProcess | None = None
    log = args.log or Path(tempfile.mkdtemp(prefix="specwhisper-storm-")) / "server.log"
    url, web_pid = args.url, args.server_pid
    if url is None:
        server = ServerProcess(log=log).launch()
        url, web_pid = server.url, server.proc.pid if server.proc else None
    try:
        if server is not None:
            await asyncio.to_thread(server.wait_ready, 300)
        url = url.rstrip("/")
        ready = httpx.get(f"{url}/health/ready", timeout=10).json()
        pids = [p for p in (web_pid, ready.get("worker_pid")) if p]
        web = PeakSampler([web_pid] if web_pid else [])
        whole = PeakSampler(pids)
        worker = PeakSampler(pids[1:] if web_pid else pids)
        run = Storm(url, short)
        run.short_text = (await run.upload(short, "short.wav")).text
        idle_latency = await run.idle_latency()
        await asyncio.sleep(1.0)
        idle_web, idle_whole = web.now(), whole.now()

        web.reset()
        status, one_s, _, _ = await run.upload(silent, "silence.flac", chunking_strategy=args.chunking)
        one = {"status": status, "seconds": round(one_s, 1), "web_peak_rise_mb": round(web.peak - idle_web, 1)}

        web.reset()
        worker.reset()
        whole.reset()
        stop = asyncio.Event()
        side = [asyncio.create_task(run.short_loop(stop)), asyncio.create_task(run.live_loop(live_audio, stop))]
        await asyncio.sleep(3.0)  # the live session under way
        started = time.monotonic()
        cpu_before = {"web": cpu_s(web_pid), "worker": cpu_s(ready.get("worker_pid")), "client": time.process_time()}
        uploads = [run.upload(silent, f"silence-{k}.flac", chunking_strategy=args.chunking) for k in range(args.silent)]
        uploads += [
            run.upload(speech, f"speech-{k}.ogg", chunking_strategy=args.speech_chunking) for k in range(args.speech)
        ]
        answers = await asyncio.gather(*uploads)
        storm_s = time.monotonic() - started
        cpu = {
            name: cpu_s(pid) - cpu_before[name] for name, pid in (("web", web_pid), ("worker", ready.get("worker_pid")))
        }
        cpu["client"] = time.process_time() - cpu_before["client"]  # this command's own share of the same cores
        stop.set()
        await asyncio.gather(*side, return_exceptions=True)
        # the same idle measure after the storm: how much the machine's own speed moved meanwhile
        idle_after = await run.idle_latency()
        for answer in answers:
            run.statuses[str(answer.status)] += 1
        finals = [t for t in run.live_finals if t >= started]
        gaps = np.diff([started, *finals, started + storm_s]).tolist()
        after = httpx.get(f"{url}/health/ready", timeout=10).json()
        for sampler in (web, worker, whole):
            sampler.stop()
        latencies = [a.seconds for _, a in run.short_answers]
        slowest = max(latencies, default=float("inf"))
        during = [(t - started, a) for t, a in run.short_answers if t >= started]
        checks = {
            "one_upload_web_rise_mb": {
                "value": one["web_peak_rise_mb"],
                "ok": one["web_peak_rise_mb"] <= args.max_one_mb,
            },
            "storm_peak_mb": {"value": round(whole.peak, 1), "ok": whole.peak <= args.max_memory_mb},
            "storm_200_or_429": {
                "value": dict(run.statuses),
                "ok": set(run.statuses) <= {"200", "429"} and not run.failures,
            },
            "short_uploads_correct": {
                "value": {"answers": dict(run.short_statuses), "wrong": run.short_wrong},
                "ok": run.short_wrong == 0 and set(run.short_statuses) <= {"200"} and bool(latencies),
            },
            "short_upload_slowdown": {
                "value": round(slowest / idle_latency, 2),
                "ok": slowest <= args.max_slowdown * idle_latency,
            },
            "live_finals_keep_arriving": {
                "value": {"finals": len(finals), "longest_gap_s": round(max(gaps), 1)},
                "ok": bool(finals) and max(gaps) <= args.max_final_gap_s,
            },
            "no_restart": {
                "value": [ready.get("worker_restarts"), after.get("worker_restarts")],
                "ok": after.get("worker_restarts") == ready.get("worker_restarts"),
            },
        }
        return {
            "url": url,
            "minutes": {"silent": args.minutes, "speech": args.speech_minutes or args.minutes},
            "upload_bytes": {"silent": len(silent), "speech": len(speech)},
            "idle": {
                "short_latency_s": round(idle_latency, 3),
                "short_latency_after_s": round(idle_after, 3),
                "web_mb": round(idle_web, 1),
                "server_mb": round(idle_whole, 1),
            },
            "one_silent_upload": one,
            "storm": {
                "silent": args.silent,
                "speech": args.speech,
                "seconds": round(storm_s, 1),
                "started_unix": round(time.time() - (time.monotonic() - started), 2),  # for samplers outside
                "answers": [{"status": a.status, "seconds": round(a.seconds, 1)} for a in answers],
                "server_peak_mb": round(whole.peak, 1),
                "web_peak_mb": round(web.peak, 1),
                "worker_peak_mb": round(worker.peak, 1),
                "short_latency_s": {
                    "median": round(statistics.median(latencies), 3) if latencies else None,
                    "max": round(slowest, 3),
                    **beside_finals([(t, a.seconds) for t, a in during], [t - started for t in finals]),
                },
                "cpu_s": {name: round(v, 1) for name, v in cpu.items()},  # over the storm, of 2 x seconds on 2 cores
                "short_answers": [  # `short_answers_columns`: where slow ones fell, and why
                    (
                        round(at, 1),
                        round(a.seconds, 2),
                        *(round(v, 2) for v in where_it_waited(a).values()),
                        a.metrics.get("batch_size", 0),
                        a.metrics.get("speculative", False),
                    )
                    for at, a in during
                ],
                "short_answers_columns": ["at_s", "latency_s", *SPLIT_PARTS, "batch_size", "speculative"],
                "slow_short_answers_waited_s": slow_parts(
                    [where_it_waited(a) for _, a in during if a.seconds > args.max_slowdown * idle_latency]
                ),
                "live_finals_at_s": [round(t - started, 1) for t in finals],
                "failures": run.failures[:5],
            },
            "checks": checks,
            "passed": all(c["ok"] for c in checks.values()),
            "server_log": str(log),
        }
    finally:
        if server is not None:
            server.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=59.0, help="length of each long upload")
    parser.add_argument("--silent", type=int, default=16, help="long silent uploads sent at once")
    parser.add_argument("--speech", type=int, default=4, help="long speech uploads sent with them")
    parser.add_argument("--speech-minutes", type=float, help="length of each speech upload (default: --minutes)")
    parser.add_argument("--chunking", default="auto", help="the silent uploads' chunking_strategy")
    parser.add_argument("--speech-chunking", default="auto", help="the speech uploads' chunking_strategy")
    parser.add_argument("--max-memory-mb", type=float, default=1500.0, help="target: the server's peak in the storm")
    parser.add_argument("--max-one-mb", type=float, default=100.0, help="target: one silent upload's web rise")
    parser.add_argument("--max-slowdown", type=float, default=3.0, help="target: short upload latency / idle")
    parser.add_argument("--max-final-gap-s", type=float, default=30.0, help="target: longest time without a final")
    parser.add_argument("--manifest", type=Path, help="benchdata manifest.jsonl (default: ../shared/benchdata)")
    add_server_arguments(parser, "memory is read from /proc")


def run_cli(args: argparse.Namespace) -> int:
    return print_verdict(asyncio.run(storm(args)), args.json)
