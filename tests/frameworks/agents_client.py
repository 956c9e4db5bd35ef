"""Transcribe a WAV file with the OpenAI Agents SDK's voice STT model, pointed at an OpenAI-compatible server.

The SDK runs on its defaults (model, settings, 24 kHz PCM16); only the client's base URL and API key change. Run it
under a separate virtualenv holding `openai-agents[voice]`, never the project's own:

    python agents_client.py --base-url http://127.0.0.1:8000/v1 --mode rest|realtime --audio speech.wav

`rest` sends the whole file through `STTModel.transcribe()`; `realtime` streams it, paced in real time, through
`create_session()` (the Realtime WebSocket API) and collects every turn. Prints one JSON line to stdout:
{"mode": MODE, "finals": [text, ...]}. Errors propagate as a traceback and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import wave

import numpy as np
import numpy.typing as npt
from agents import set_tracing_disabled
from agents.voice import AudioInput, OpenAIVoiceModelProvider, StreamedAudioInput, STTModel, STTModelSettings
from openai import AsyncOpenAI

SDK_RATE = 24000  # the rate the SDK assumes by default (agents.voice.input.DEFAULT_SAMPLE_RATE)
CHUNK_S = 0.1  # one pushed buffer, as a microphone callback would deliver it
TRAILING_SILENCE_S = 3.0
TIMEOUT_S = 150.0

Pcm = npt.NDArray[np.int16]


def load_audio(path: str) -> Pcm:
    """Reads a mono int16 WAV and resamples it (linear interpolation) to the SDK's 24 kHz."""
    with wave.open(path, "rb") as wav:
        if wav.getnchannels() != 1 or wav.getsampwidth() != 2:
            raise ValueError(f"{path}: expected mono 16-bit PCM")
        rate = wav.getframerate()
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").astype(np.float64)
    out_times = np.arange(round(len(samples) * SDK_RATE / rate)) / SDK_RATE
    resampled = np.interp(out_times, np.arange(len(samples)) / rate, samples)
    return np.round(resampled).astype(np.int16)


async def transcribe_rest(model: STTModel, audio: Pcm) -> list[str]:
    text = await model.transcribe(
        AudioInput(buffer=audio),
        STTModelSettings(),
        trace_include_sensitive_data=False,
        trace_include_sensitive_audio_data=False,
    )
    return [text]


async def push_paced(stream: StreamedAudioInput, audio: Pcm) -> None:
    """Pushes the audio then trailing silence in real time, then ends the input as the SDK documents (None)."""
    chunk = int(SDK_RATE * CHUNK_S)
    padded = np.concatenate([audio, np.zeros(int(SDK_RATE * TRAILING_SILENCE_S), dtype=np.int16)])
    start = time.monotonic()
    for index, offset in enumerate(range(0, len(padded), chunk)):
        await asyncio.sleep(max(0.0, start + index * CHUNK_S - time.monotonic()))
        await stream.add_audio(padded[offset : offset + chunk])
    await stream.add_audio(None)


async def transcribe_realtime(model: STTModel, audio: Pcm) -> list[str]:
    stream = StreamedAudioInput()
    session = await model.create_session(
        stream,
        STTModelSettings(),
        trace_include_sensitive_data=False,
        trace_include_sensitive_audio_data=False,
    )
    finals: list[str] = []

    async def collect() -> None:
        # The session connects when iteration starts; audio pushed before then waits in the input's queue.
        async for text in session.transcribe_turns():
            finals.append(text)

    try:
        await asyncio.gather(collect(), push_paced(stream, audio))
    finally:
        await session.close()
    return finals


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://host:port/v1")
    parser.add_argument("--mode", required=True, choices=["rest", "realtime"])
    parser.add_argument("--audio", required=True, help="a mono 16-bit PCM WAV file")
    args = parser.parse_args()

    set_tracing_disabled(True)  # no trace export: the server under test is the only endpoint reachable
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused")
    model = OpenAIVoiceModelProvider(openai_client=client).get_stt_model(None)  # the SDK's default model
    audio = load_audio(args.audio)
    transcribe = transcribe_rest if args.mode == "rest" else transcribe_realtime
    finals = await asyncio.wait_for(transcribe(model, audio), TIMEOUT_S)
    print(json.dumps({"mode": args.mode, "finals": finals}))


if __name__ == "__main__":
    asyncio.run(main())
