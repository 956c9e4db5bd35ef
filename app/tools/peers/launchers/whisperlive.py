"""WhisperLive's server (faster_whisper backend) on a local CTranslate2 folder, decoding greedily.

Run by the Python of WhisperLive's environment (app/tools/peers/install.py). Its defaults otherwise, with
three settings a benchmark needs: one model shared by all clients (`single_model`, WhisperLive's mode for a
custom model; without it each WebSocket client loads its own), room for every session the benchmark opens
(`max_clients`, 4 by default), and its OpenAI-compatible REST API on (`enable_rest`).

Greedy: WhisperLive passes no `beam_size`, so faster-whisper's default of 5 applies, on its WebSocket path and
its REST path alike. Both `WhisperModel` classes it uses (faster-whisper's, for REST, and its own copy, for
live audio) get `beam_size=1` as the default of `transcribe`; a caller that names a beam size keeps it.
CTranslate2 takes its thread count from OMP_NUM_THREADS (the benchmark sets it).
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any


def _greedy_by_default(cls: Any) -> None:
    original = cls.transcribe

    @functools.wraps(original)
    def transcribe(self: Any, audio: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("beam_size", 1)
        return original(self, audio, *args, **kwargs)

    cls.transcribe = transcribe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a CTranslate2 Whisper folder")
    parser.add_argument("--port", type=int, required=True, help="the WebSocket port")
    parser.add_argument("--rest-port", type=int, required=True)
    parser.add_argument("--max-clients", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import faster_whisper
    from whisper_live.server import TranscriptionServer
    from whisper_live.transcriber import transcriber_faster_whisper

    _greedy_by_default(faster_whisper.WhisperModel)
    _greedy_by_default(transcriber_faster_whisper.WhisperModel)
    TranscriptionServer().run(
        "127.0.0.1",
        port=args.port,
        backend="faster_whisper",
        faster_whisper_custom_model_path=args.model,
        single_model=True,
        max_clients=args.max_clients,
        enable_rest=True,
        rest_port=args.rest_port,
    )


if __name__ == "__main__":
    main()
