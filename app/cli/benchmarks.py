"""The command line's benchmarks and load tools: bench, bench-precision, bench-audio, realtimebench, peerbench,
gpubench, loadtest, soak, storm."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, get_args

from app.cli.flags import add_common, overrides, settings_of
from app.settings import DtypeName
from app.tools.manifest import default_manifest


def _printed(report: object, args: argparse.Namespace) -> int:
    """Print a benchmark's JSON report, and write it to `--json` where given."""
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


def _bench_server(args: argparse.Namespace) -> int:
    from app.tools.serverbench import run_server_bench

    # The servers read their settings from the environment: the engine flags go there.
    env = {f"SPECWHISPER_{key.upper()}": str(value) for key, value in overrides(args).items()}
    report = run_server_bench(
        args.manifest,
        [int(c) for c in args.concurrency.split(",")],
        modes=args.modes.split(","),
        limit=args.limit or 8,
        requests_per_client=args.requests_per_client,
        rounds=args.rounds,
        languages=set(args.languages.split(",")) if args.languages else None,
        subset=args.subset,
        max_seconds=args.max_seconds,
        env=env,
    )
    return _printed(report, args)


def _bench(args: argparse.Namespace) -> int:
    if args.concurrency:
        return _bench_server(args)
    from app.engine.build import build_engine
    from app.tools.bench import plot, run_bench

    settings = settings_of(args)
    engine = build_engine(settings, progress=False)
    languages = set(args.languages.split(",")) if args.languages else None
    batches = [int(b) for b in args.batch.split(",")] if args.batch else []
    report = run_bench(
        engine,
        args.manifest,
        languages=languages,
        limit=args.limit,
        batches=batches,
        max_seconds=args.max_seconds,
        subset=args.subset,
        settings=settings,
        rss_split=not args.no_rss_split,
        compare_hf=args.compare_hf,
        compare_faster_whisper=args.compare_faster_whisper,
        beams=[int(b) for b in args.beam.split(",")],
    )
    summary = {k: v for k, v in report.items() if k not in ("per_clip", "languages")}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0


def _bench_precision(args: argparse.Namespace) -> int:
    from app.tools.precisionbench import run_precision_bench

    report = run_precision_bench(
        args.manifest,
        args.dtypes.split(","),
        per_set=args.per_set,
        languages=set(args.languages.split(",")) if args.languages else None,
        condition_clips=args.condition_clips,
        dithers=args.dithers,
        settings=settings_of(args),  # --threads and the engine flags
    )
    return _printed(report, args)


def _bench_audio(args: argparse.Namespace) -> int:
    if args.part == "diarization":
        from app.tools.diarizationbench import run_diarization_bench, table

        report = run_diarization_bench(args.manifest, args.conversation_seconds, args.long_minutes)
        print(table(report))
        return _printed(report, args)
    if args.part == "noise-reduction":
        from app.tools.noisereduction import run_noise_reduction_bench

        report = run_noise_reduction_bench(args.manifest, args.clips)
    else:
        from app.tools.realaudio import run_bench_audio

        report = run_bench_audio(
            args.manifest, args.part, args.long_minutes, args.reference, args.threads or 2, clips=args.clips
        )
    return _printed(report, args)


def _realtime_bench(args: argparse.Namespace) -> int:
    from app.tools.realtimebench import run_realtime_bench

    report = run_realtime_bench(
        args.manifest,
        [int(n) for n in args.sessions.split(",")],
        args.formats.split(","),
        args.clips,
        args.silence_ms,
        args.url,
        tuple(args.turn_detection.split(",")),
        args.pause_ms,
    )
    return _printed(report, args)


def _peer_bench(args: argparse.Namespace) -> int:
    from app.tools.peers.bench import plot, run_peer_bench, table

    report = run_peer_bench(
        args.manifest,
        [p for p in args.peers.split(",") if p],
        [int(c) for c in args.clients.split(",")],
        [int(n) for n in args.sessions.split(",") if n],
        n_clips=args.clips,
        requests=args.requests,
        live_clips=args.live_clips,
        threads=args.threads,
        model=args.model,
        chunk_ms=args.chunk_ms,
        silence_ms=args.silence_ms,
        peers_dir=args.peers_dir,
        settings={"SPECWHISPER_DTYPE": args.dtype} if args.dtype else None,
    )
    print(table(report))
    print(json.dumps(report["targets"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    return 0


GPUBENCH_HELP = "per-step draft/verify/main costs with random large-v3 weights"


def gpubench(args: argparse.Namespace) -> int:
    from app.tools.gpubench import add_arguments, run_cli

    # Its options are parsed here, so that no other command (serve above all) loads torch for them.
    parser = argparse.ArgumentParser(prog="python -m app gpubench", description=GPUBENCH_HELP)
    add_arguments(parser)
    return run_cli(parser.parse_args(args.gpubench_options))


def add_commands(commands: Any) -> None:
    """Add the benchmark and load-tool commands to `commands` (the parser's subparsers)."""
    bench = commands.add_parser("bench", help="main-only vs speculative, side by side")
    bench.add_argument("--manifest", type=Path, required=True, help="benchdata manifest.jsonl")
    bench.add_argument("--languages", help="comma-separated language codes")
    bench.add_argument("--limit", type=int, help="at most N clips")
    bench.add_argument("--subset", choices=["short", "long"], help="only the manifest's short or long-form clips")
    bench.add_argument(
        "--max-seconds", type=float, help="longest clip taken (default 30 s, one window; unbounded with --subset long)"
    )
    bench.add_argument("--batch", help="batch sizes for throughput, e.g. 1,2,4")
    bench.add_argument("--beam", default="1", help="beam sizes, e.g. 1,5 (1: greedy); each runs plain and speculative")
    bench.add_argument("--json", type=Path, help="write the full report here")
    bench.add_argument("--concurrency", help="through the server instead: concurrent clients per level, e.g. 1,4,8,16")
    bench.add_argument(
        "--modes", default="adaptive,always,never", help="with --concurrency: the speculation settings compared"
    )
    bench.add_argument(
        "--requests-per-client",
        type=int,
        default=2,
        help="with --concurrency: answers per client in a round (at least one per clip)",
    )
    bench.add_argument("--rounds", type=int, default=3, help="with --concurrency: rounds per mode and level")
    bench.add_argument("--plot", type=Path, help="write a PNG of per-clip speedup vs acceptance")
    bench.add_argument(
        "--compare-hf", action="store_true", help="also transformers' generate(), plain and assistant_model="
    )
    bench.add_argument(
        "--compare-faster-whisper",
        action="store_true",
        help="also faster-whisper (fp32, at each --beam size) on the same converted weights (optional dependency)",
    )
    bench.add_argument(
        "--no-rss-split", action="store_true", help="skip measuring each mode's peak RSS in a child process"
    )
    add_common(bench)
    bench.set_defaults(handler=_bench)

    precision = commands.add_parser(
        "bench-precision", help="dtypes side by side (float32, int8): encoder and decode speed, exactness, WER by set"
    )
    precision.add_argument("--manifest", type=Path, default=default_manifest(), help="benchdata manifest.jsonl")
    precision.add_argument("--dtypes", default="float32,int8", help="the dtypes compared, the first the baseline")
    precision.add_argument("--per-set", type=int, help="at most N clips of each language (default: all)")
    precision.add_argument("--languages", help="comma-separated language codes (default: all)")
    precision.add_argument(
        "--condition-clips", type=int, default=8, help="English clips joined into each noise and telephone condition"
    )
    precision.add_argument(
        "--dithers",
        type=int,
        default=0,
        help="also transcribe every clip N times with inaudible seeded dither, for each set's WER spread",
    )
    precision.add_argument("--json", type=Path, help="write the report here")
    add_common(precision)
    precision.set_defaults(handler=_bench_precision)

    # Its own parser takes its options (main() hands them over), and `gpubench --help` lists them.
    audio = commands.add_parser(
        "bench-audio", help="real-world audio: made-up words on non-speech, WER on hard speech, long files"
    )
    audio.add_argument("--manifest", type=Path, default=default_manifest(), help="benchdata manifest.jsonl")
    audio.add_argument(
        "--part",
        choices=["conditions", "long", "all", "noise-reduction", "diarization"],
        default="all",
        help="all: conditions and long; noise-reduction: WER and turn detection behind noise suppressors;"
        " diarization: who spoke when (DER) on conversations of 2-4 voices, its time and memory",
    )
    audio.add_argument(
        "--conversation-seconds", type=float, default=120.0, help="diarization: length of each conversation"
    )
    audio.add_argument("--long-minutes", type=float, default=10.0, help="length of the long file")
    audio.add_argument(
        "--clips", type=int, default=24, help="English short clips in each speech condition (24: ~2.7 min, ~400 words)"
    )
    audio.add_argument("--reference", action="store_true", help="also run openai-whisper's transcribe() (slow)")
    audio.add_argument("--threads", type=int, help="faster-whisper's CPU threads (default 2)")
    audio.add_argument("--json", type=Path, help="write the report here")
    audio.set_defaults(handler=_bench_audio)

    live = commands.add_parser(
        "realtimebench", help="live latency: clips streamed in real time over N Realtime sessions, p50/p95"
    )
    live.add_argument("--manifest", type=Path, default=default_manifest(), help="benchdata manifest.jsonl")
    live.add_argument("--sessions", default="1,4,8", help="concurrent session counts (comma-separated)")
    live.add_argument("--formats", default="pcm16,g711_ulaw", help="input formats (pcm16, g711_ulaw, g711_alaw)")
    live.add_argument("--clips", type=int, default=6, help="English clips (3-15 s) each session streams in turn")
    live.add_argument("--silence-ms", type=int, default=500, help="server VAD silence_duration_ms")
    live.add_argument(
        "--turn-detection", default="server_vad", help="server_vad and/or semantic_vad (comma-separated), in turn"
    )
    live.add_argument(
        "--pause-ms", type=int, default=0, help="silence put inside a sentence of each clip (mid-sentence pauses)"
    )
    live.add_argument("--url", help="a running server (default: start one)")
    live.add_argument("--json", type=Path, help="write the report here")
    live.set_defaults(handler=_realtime_bench)

    peers = commands.add_parser(
        "peerbench", help="SpecWhisper against peer servers (WhisperLive, faster-whisper-server): same weights and load"
    )
    peers.add_argument("--manifest", type=Path, default=default_manifest(), help="benchdata manifest.jsonl")
    peers.add_argument("--peers", default="whisperlive,faster-whisper-server", help="peers (comma-separated)")
    peers.add_argument("--clients", default="1,2,4,8,16", help="concurrent upload clients (comma-separated)")
    peers.add_argument("--sessions", default="1,4,8", help="concurrent live sessions (comma-separated; '' for none)")
    peers.add_argument("--clips", type=int, default=8, help="English clips (3-15 s) the uploads cycle through")
    peers.add_argument("--requests", type=int, default=32, help="uploads at each concurrency")
    peers.add_argument("--live-clips", type=int, default=4, help="of those clips, how many each live session streams")
    peers.add_argument("--threads", type=int, default=2, help="CPU threads of every server")
    peers.add_argument("--model", default="whisper-base", help="an embedded model (its CTranslate2 files go to peers)")
    peers.add_argument("--chunk-ms", type=int, default=100, help="live audio sent in chunks of this duration")
    peers.add_argument("--silence-ms", type=int, default=500, help="SpecWhisper's server VAD silence_duration_ms")
    peers.add_argument("--dtype", choices=get_args(DtypeName), help="SpecWhisper's dtype (default: its own default)")
    peers.add_argument("--peers-dir", type=Path, help="peers' environments and weights (default: user cache)")
    peers.add_argument("--json", type=Path, help="write the report here")
    peers.add_argument("--plot", type=Path, help="write a PNG of throughput and latency by load here")
    peers.set_defaults(handler=_peer_bench)

    gpu = commands.add_parser("gpubench", help=GPUBENCH_HELP, add_help=False)
    gpu.set_defaults(handler=gpubench)

    from app.tools import loadtest, soak, storm

    for name, tool, text in (
        ("loadtest", loadtest, "N concurrent clients against a server, every answer checked (JSON report)"),
        ("soak", soak, "long mixed upload + WebSocket traffic; RSS, fds, threads, tasks, /dev/shm verdict"),
        ("storm", storm, "hour-long uploads in small files at once, with short uploads and a live session"),
    ):
        sub = commands.add_parser(name, help=text)
        tool.add_arguments(sub)
        sub.set_defaults(handler=tool.run_cli)
