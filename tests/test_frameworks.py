"""Voice-agent frameworks on their defaults, only their OpenAI base URL changed, against the real server.

LiveKit Agents (`openai.STT`: `recognize()` over REST, `stream()` with `use_realtime=True`), Pipecat
(`OpenAISTTService` over REST per local-VAD segment, `OpenAIRealtimeSTTService`) and the OpenAI Agents SDK
(`transcribe()`, `create_session()` with its default semantic VAD) each run in a virtual environment of their own
(`app/tools/peers/install.py`: made once in the user's cache; the project never imports them), through a small
client script in `tests/frameworks/` that streams real speech in real time and prints the finals it got. Each
mode must end without an error and give the words an upload of the same audio gives, every turn's last word
included.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI

from app.api.audio import load_audio
from app.tools.bench import error_rate
from app.tools.peers.install import ensure_env
from tests.server import ServerProcess, openai_client

CLIENTS = Path(__file__).parent / "frameworks"
CLIPS = ("ljspeech/LJ001-0001", "whisper/jfk")  # two speakers' turns, 2 s apart
LAST_WORDS = ("exhibition", "country")
SCRIPT = {"livekit": "livekit_client.py", "pipecat": "pipecat_client.py", "openai-agents": "agents_client.py"}


@pytest.fixture(scope="module")
def server(live_server: ServerProcess) -> ServerProcess:
    return live_server


@pytest.fixture(scope="module")
def conversation(benchdata: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two clips as one 16-kHz recording: 0.5 s of silence, each clip followed by 2 s of it."""
    gap = np.zeros(32000, np.float32)
    parts = [gap[:8000]] + [p for c in CLIPS for p in (load_audio(benchdata / "audio" / f"{c}.wav"), gap)]
    path = tmp_path_factory.mktemp("frameworks") / "conversation.wav"
    sf.write(path, np.concatenate(parts), 16000, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def uploaded(server: ServerProcess, conversation: Path) -> str:
    """What an upload of the whole recording gives (the official SDK, whisper-1)."""
    client: OpenAI = openai_client(server)
    return client.audio.transcriptions.create(model="whisper-1", file=conversation.open("rb"), language="en").text


def run_client(framework: str, mode: str, server: ServerProcess, audio: Path) -> list[str]:
    python = ensure_env(framework)
    done = subprocess.run(
        [str(python), str(CLIENTS / SCRIPT[framework]), "--base-url", f"{server.url}/v1", "--mode", mode,
         "--audio", str(audio)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{framework} {mode} failed:\n{done.stderr[-6000:]}"
    finals = json.loads(done.stdout.strip().splitlines()[-1])["finals"]
    assert isinstance(finals, list) and all(isinstance(f, str) for f in finals)
    return finals


@pytest.mark.slow
@pytest.mark.parametrize(
    ("framework", "mode"),
    [(f, m) for f in ("livekit", "pipecat", "openai-agents") for m in ("rest", "realtime")],
)
def test_framework_on_its_defaults(
    framework: str, mode: str, server: ServerProcess, conversation: Path, uploaded: str
) -> None:
    finals = run_client(framework, mode, server, conversation)
    heard = " ".join(finals)
    # The words an upload gives, every turn's last word included. Where the client cuts the audio itself (Pipecat's
    # local VAD, every 0.2 s of silence) or resamples it (to 24 kHz), a word at a cut may be heard differently.
    wer = error_rate([(uploaded, heard, "en")])
    assert wer <= 0.12, (framework, mode, finals, uploaded, wer)
    lowered = heard.lower()
    assert all(word in lowered for word in LAST_WORDS), (framework, mode, finals)
    if (framework, mode) == ("livekit", "rest"):  # the same 16-kHz file in one request: exactly the upload
        assert finals == [uploaded]
