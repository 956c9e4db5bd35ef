"""`python -m app ...`: transcribe files, serve, manage the model store and the kernels (the benchmarks and load
tools: benchmarks.py)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from app.api.formats import FORMATS
from app.cli.benchmarks import add_commands, gpubench
from app.cli.flags import add_common, add_store, overrides, settings_of


def _transcribe(args: argparse.Namespace) -> int:
    from app.cli.transcribe import run_transcribe

    return run_transcribe(args, settings_of(args))


def _serve(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return _serve_on_ray(args)
    import uvicorn

    from app.server.app import create_app

    address = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    settings = settings_of(args).model_copy(update=address)
    failures: list[str] = []

    def stop(reason: str) -> None:  # the worker cannot load the models: a restart would not help
        failures.append(reason)
        server.should_exit = True

    config = uvicorn.Config(
        create_app(settings, on_fatal=stop),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
    )
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises a Ctrl+C after its graceful shutdown
        server.run()
    if failures:
        print(f"error: the server stopped: {failures[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's own status for a failed start-up


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from app.server.cluster.run import serve_on_ray
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    settings = settings_of(args)
    options = {
        key: value
        for key in ("min_replicas", "max_replicas", "replica_cpus", "replica_gpus")
        if (value := getattr(args, key)) is not None
    }
    return serve_on_ray(
        args.ray, {"settings": overrides(args), **options}, args.host or settings.host, args.port or settings.port
    )


def _models(args: argparse.Namespace) -> int:
    from app.cli.models import run_models

    return run_models(args, settings_of(args))


def _kernels(args: argparse.Namespace) -> int:
    from app.model.native import install_portable, kernel_isa, prebuilt_dir

    if args.install is not None:
        path = install_portable(Path(args.install) if args.install else prebuilt_dir())
        print(f"kernel library: portable build installed at {path}")
    isa = kernel_isa()
    print(f"kernel library: {f'built ({isa})' if isa else 'unavailable: torch int8 for the drafts, torch attention'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description="SpecWhisper: speculative Whisper")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)

    tr = commands.add_parser("transcribe", help="transcribe audio files")
    tr.add_argument("files", nargs="+", type=Path, metavar="FILE")
    tr.add_argument("--language", help="language code (default: detect)")
    tr.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    tr.add_argument("--no-assistant", action="store_true", help="main model only (plain decoding)")
    tr.add_argument("--beam-size", type=int, default=1, help="beam search with N hypotheses (1 = greedy, default)")
    tr.add_argument("--patience", type=float, help="beam search: collect round(N * patience) finished hypotheses")
    tr.add_argument("--length-penalty", type=float, help="beam search: rank by ((5 + length) / 6) ** this")
    tr.add_argument("--best-of", type=int, help="samples per window above temperature 0 (default: the beam size)")
    tr.add_argument("--format", choices=list(FORMATS), default="text")
    tr.add_argument("--timestamps", choices=["segment", "word"], help="segment or word timestamps")
    tr.add_argument("--prompt", help="text to condition the first window on (names, spelling, style)")
    tr.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    tr.add_argument("--fallback", action="store_true", help="OpenAI's temperature fallback 0.0..1.0")
    tr.add_argument("--batch", action="store_true", help="decode the files together, in batches of up to 4")
    tr.add_argument("--draft-tokens", type=int, help="initial draft length")
    add_common(tr)
    tr.set_defaults(handler=_transcribe)

    serve = commands.add_parser("serve", help="run the HTTP server (OpenAI-compatible API)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    add_common(serve)
    cluster = serve.add_argument_group("on a Ray cluster (the `ray` extra; docs/deployment.md)")
    cluster.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="serve with Ray Serve on the cluster at ADDRESS ('auto': the one this machine is a node of;"
        " 'local': start one here), engine replicas scaled by load",
    )
    cluster.add_argument("--min-replicas", type=int, help="engine replicas kept however idle (default 1)")
    cluster.add_argument("--max-replicas", type=int, help="engine replicas at most (default 4)")
    cluster.add_argument("--replica-cpus", type=float, help="CPUs reserved per engine replica (default 1)")
    cluster.add_argument("--replica-gpus", type=float, help="GPUs per engine replica (default 0)")
    serve.set_defaults(handler=_serve)

    add_commands(commands)

    kernels = commands.add_parser(
        "kernels", help="build this CPU's kernel library now (int8 drafts, decoder attention; else on first use)"
    )
    kernels.add_argument(
        "--install",
        nargs="?",
        const="",
        metavar="DIR",
        help="compile a portable build (any x86-64 CPU with AVX2 + FMA) into DIR, for runtimes without a compiler "
        "(default DIR: $SPECWHISPER_KERNEL_DIR, else inside the package)",
    )
    kernels.set_defaults(handler=_kernels)

    models = commands.add_parser("models", help="show or convert models in the store")
    models_cmd = models.add_subparsers(dest="models_command", required=True)
    ls = models_cmd.add_parser("list", help="embedded and converted models")
    add_store(ls)
    cv = models_cmd.add_parser("convert", help="convert embedded or CTranslate2 models into the store")
    cv.add_argument("sources", nargs="*", help="embedded model names or CT2 directories (default: all embedded)")
    cv.add_argument("--force", action="store_true", help="convert again even if present")
    cv.add_argument("--name", help="store name for a converted directory")
    add_store(cv)
    models.set_defaults(handler=_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.handler is gpubench:
        args.gpubench_options = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.handler(args))
