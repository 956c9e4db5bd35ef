"""Transcribe a WAV with LiveKit Agents' OpenAI STT plugin, on its defaults, against an OpenAI-compatible server.

Run it with the python of a separate virtualenv that has livekit-agents and livekit-plugins-openai:

    python livekit_client.py --base-url http://127.0.0.1:PORT/v1 --mode rest|realtime --audio speech.wav

Only the base URL and API key differ from the plugin's defaults. `rest` sends the whole file to `recognize()`;
`realtime` streams it, paced in real time, through `stream(use_realtime=True)` (server VAD ends each turn).
Prints one JSON line, {"mode": ..., "finals": [...], "interims": N}; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import wave
from dataclasses import dataclass

from livekit import rtc
from livekit.agents import stt, utils
from livekit.plugins import openai

FRAME_MS = 20  # frame length pushed to the plugin, at the file's own sample rate
TRAILING_SILENCE_S = 3.0  # silence pushed after the audio, so server VAD can end the last turn
COLLECT_TIMEOUT_S = 60.0  # longest wait for the last events once the input has ended
SETTLE_S = 2.0  # quiet time, with every started turn completed, after which no more events are expected
OVERALL_TIMEOUT_S = 150.0

log = logging.getLogger("livekit_client")


def read_frames(path: str) -> list[rtc.AudioFrame]:
    """Split a mono int16 WAV into FRAME_MS frames, as a room would deliver them (the last one padded)."""
    with wave.open(path, "rb") as wav:
        if wav.getnchannels() != 1 or wav.getsampwidth() != 2:
            raise ValueError(f"{path}: expected mono int16 audio")
        rate = wav.getframerate()
        pcm = wav.readframes(wav.getnframes())
    samples = rate * FRAME_MS // 1000
    size = samples * 2
    pcm += bytes(-len(pcm) % size)
    return [rtc.AudioFrame(pcm[i : i + size], rate, 1, samples) for i in range(0, len(pcm), size)]


async def run_rest(base_url: str, frames: list[rtc.AudioFrame]) -> tuple[list[str], int]:
    recognizer = openai.STT(base_url=base_url, api_key="unused")
    try:
        event = await recognizer.recognize(frames)
    finally:
        await recognizer.aclose()
    log.info("recognize: %s %r", event.type, [alt.text for alt in event.alternatives])
    finals = [event.alternatives[0].text] if event.type == stt.SpeechEventType.FINAL_TRANSCRIPT else []
    return finals, 0


@dataclass
class Events:
    finals: list[str]
    interims: int = 0
    open_turns: int = 0  # turns the server started (START_OF_SPEECH) and has not completed yet
    last_at: float = 0.0  # loop time of the last event


async def collect(stream: stt.SpeechStream, events: Events) -> None:
    loop = asyncio.get_running_loop()
    async for ev in stream:
        events.last_at = loop.time()
        text = ev.alternatives[0].text if ev.alternatives else ""
        log.info("event %s %r", ev.type.name, text)
        if ev.type == stt.SpeechEventType.START_OF_SPEECH:
            events.open_turns += 1
        elif ev.type == stt.SpeechEventType.RECOGNITION_USAGE:  # sent once per completed turn, even an empty one
            events.open_turns -= 1
        elif ev.type == stt.SpeechEventType.FINAL_TRANSCRIPT:
            events.finals.append(text)
        elif ev.type == stt.SpeechEventType.INTERIM_TRANSCRIPT:
            events.interims += 1


async def run_realtime(base_url: str, frames: list[rtc.AudioFrame]) -> tuple[list[str], int]:
    recognizer = openai.STT(base_url=base_url, api_key="unused", use_realtime=True)
    stream = recognizer.stream()
    events = Events(finals=[])
    collector = asyncio.create_task(collect(stream, events))
    loop = asyncio.get_running_loop()
    try:
        rate, samples = frames[0].sample_rate, frames[0].samples_per_channel
        silence = rtc.AudioFrame.create(rate, 1, samples)
        paced = frames + [silence] * round(TRAILING_SILENCE_S * 1000 / FRAME_MS)
        start = loop.time()
        for i, frame in enumerate(paced):
            if collector.done():  # the stream stopped early: raise why
                collector.result()
                raise RuntimeError("the stream ended before its input")
            stream.push_frame(frame)
            await asyncio.sleep(max(0.0, start + (i + 1) * FRAME_MS / 1000 - loop.time()))
        stream.end_input()
        log.info("input ended after %.1f s of audio", len(paced) * FRAME_MS / 1000)

        # The plugin keeps its pooled socket open after end_input, so the stream only ends if the server closes it.
        deadline = loop.time() + COLLECT_TIMEOUT_S
        while not collector.done() and loop.time() < deadline:
            if events.open_turns <= 0 and loop.time() - max(events.last_at, start) >= SETTLE_S:
                break
            await asyncio.sleep(0.1)
        if collector.done():
            collector.result()  # raises what the stream raised
        else:
            log.info("stopped collecting with %d open turn(s)", events.open_turns)
    finally:
        collector.cancel()
        await stream.aclose()
        await recognizer.aclose()
    return events.finals, events.interims


async def main(args: argparse.Namespace) -> dict[str, object]:
    frames = read_frames(args.audio)
    # Outside a LiveKit job there is no shared aiohttp session; the realtime websocket needs one.
    async with utils.http_context.open():
        run = run_rest if args.mode == "rest" else run_realtime
        finals, interims = await run(args.base_url, frames)
    return {"mode": args.mode, "finals": finals, "interims": interims}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--mode", required=True, choices=["rest", "realtime"])
    parser.add_argument("--audio", required=True, help="mono int16 WAV")
    cli_args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = asyncio.run(asyncio.wait_for(main(cli_args), OVERALL_TIMEOUT_S))
    print(json.dumps(result), flush=True)
