"""Transcribe a WAV file with Pipecat's OpenAI STT services, pointed at an OpenAI-compatible server.

The services run on their defaults (model, language, 24 kHz realtime audio); only the base URL and API key change.
Run it under a separate virtualenv holding `pipecat-ai[openai]`, never the project's own:

    python pipecat_client.py --base-url http://127.0.0.1:8000/v1 --mode rest|realtime --audio speech.wav

Both modes run a real Pipeline, as a Pipecat app does: a source pushes the file as 20 ms InputAudioRawFrames paced in
real time, then trailing silence; Pipecat's local Silero VAD (VADProcessor, default parameters) marks the turns; the STT
service follows; a sink collects the transcripts. The pipeline ends once every turn's transcript has arrived.
`rest` uses OpenAISTTService, which posts each VAD segment to /audio/transcriptions; `realtime` uses
OpenAIRealtimeSTTService (turn_detection null by default), which streams to /realtime and commits on each VAD stop.
Prints one JSON line to stdout: {"mode": MODE, "finals": [text, ...], "interims": N}. Logs go to stderr; an error from
the pipeline exits non-zero with the error on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import sys
import time
import wave

from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndWorkerFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    StartFrame,
    TranscriptionFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.stt import OpenAIRealtimeSTTService, OpenAISTTService
from pipecat.services.stt_service import STTService
from pipecat.workers.runner import WorkerRunner

RATE = 16000  # the file's rate, and Pipecat's default pipeline input rate
FRAME_S = 0.02  # one InputAudioRawFrame, as a transport delivers it
TRAILING_SILENCE_S = 3.0  # lets the VAD close the last turn
DRAIN_TIMEOUT_S = 30.0  # after the audio, how long to wait for the transcripts of turns the VAD has closed
TIMEOUT_S = 150


def load_pcm(path: str) -> bytes:
    """Reads a 16 kHz mono int16 WAV as raw PCM."""
    with wave.open(path, "rb") as wav:
        if (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) != (RATE, 1, 2):
            raise ValueError(f"{path}: expected 16 kHz mono 16-bit PCM")
        return wav.readframes(wav.getnframes())


class TranscriptSink(FrameProcessor):
    """Collects the final transcripts, counts the interim ones and the turns the VAD closed."""

    def __init__(self) -> None:
        super().__init__()
        self.finals: list[str] = []
        self.interims = 0
        self.turns = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            self.finals.append(frame.text)
        elif isinstance(frame, InterimTranscriptionFrame):
            self.interims += 1
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self.turns += 1
        await self.push_frame(frame, direction)

    async def drain(self) -> None:
        """Waits until every closed turn has its transcript (an empty one has none, hence the time limit)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while len(self.finals) < self.turns and time.monotonic() < deadline:
            await asyncio.sleep(0.1)


class PacedAudioSource(FrameProcessor):
    """Plays the role of a transport's input: pushes the audio in real time, then ends the pipeline.

    Ending stops the STT service (the realtime one closes its socket at once), so it first waits for the transcripts
    still in flight, as a live app would receive them.
    """

    def __init__(self, pcm: bytes, sink: TranscriptSink) -> None:
        super().__init__()
        self._pcm = pcm + bytes(int(RATE * TRAILING_SILENCE_S) * 2)
        self._sink = sink
        self._task: asyncio.Task[None] | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self._task = self.create_task(self._play())

    async def _play(self) -> None:
        size = int(RATE * FRAME_S) * 2
        start = time.monotonic()
        for index, offset in enumerate(range(0, len(self._pcm), size)):
            await asyncio.sleep(max(0.0, start + index * FRAME_S - time.monotonic()))
            chunk = self._pcm[offset : offset + size].ljust(size, b"\0")
            await self.push_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
        await self._sink.drain()
        await self.push_frame(EndWorkerFrame(reason="audio finished"))  # flushes what is queued, then ends

    async def cleanup(self) -> None:
        await super().cleanup()
        if self._task is not None:
            await self.cancel_task(self._task)


def make_stt(mode: str, base_url: str) -> STTService:
    if mode == "rest":
        return OpenAISTTService(api_key="unused", base_url=base_url)
    ws_url = base_url.rstrip("/").replace("http", "ws", 1) + "/realtime"  # http→ws, https→wss
    return OpenAIRealtimeSTTService(api_key="unused", base_url=ws_url)


async def run(mode: str, base_url: str, pcm: bytes) -> tuple[TranscriptSink, list[str]]:
    sink = TranscriptSink()
    pipeline = Pipeline(
        [PacedAudioSource(pcm, sink), VADProcessor(vad_analyzer=SileroVADAnalyzer()), make_stt(mode, base_url), sink]
    )
    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=RATE))
    errors: list[str] = []

    @worker.event_handler("on_pipeline_error")
    async def on_pipeline_error(worker: PipelineWorker, frame: ErrorFrame) -> None:
        errors.append(f"{frame.processor}: {frame.error}")
        await worker.cancel(reason="error")

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    return sink, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://host:port/v1")
    parser.add_argument("--mode", required=True, choices=["rest", "realtime"])
    parser.add_argument("--audio", required=True, help="a 16 kHz mono 16-bit PCM WAV file")
    args = parser.parse_args()

    logger.remove()
    logger.add(sys.stderr, level="INFO")
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)  # hard stop, even if a cancellation gets swallowed
    sink, errors = asyncio.run(run(args.mode, args.base_url, load_pcm(args.audio)))
    if errors:
        sys.exit("pipeline error: " + "; ".join(errors))
    print(json.dumps({"mode": args.mode, "finals": sink.finals, "interims": sink.interims}))


if __name__ == "__main__":
    main()
