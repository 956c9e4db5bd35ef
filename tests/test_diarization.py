"""Who spoke when, through a real server and the official OpenAI SDK: `response_format=diarized_json` (with known
speakers, bounds, streaming), verbose_json with `diarize=true`, and the requests OpenAI refuses."""

from __future__ import annotations

import base64
import io
import itertools
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from openai import BadRequestError, OpenAI
from pyannote.core import Annotation
from pyannote.core import Segment as Span
from pyannote.metrics.diarization import DiarizationErrorRate
from websockets.sync.client import connect

from app.tools import conversations
from app.tools.manifest import read_manifest
from tests.server import ServerProcess, openai_client, server_fixture

SR = 16000

server = server_fixture({"SPECWHISPER_BATCH_WINDOW_MS": "100"}, name="diarization-server")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def talk(benchdata: Path) -> conversations.Conversation:
    """About 45 s of two readers taking turns (the references: each one's audio kept out of the turns)."""
    pool = conversations.voices(read_manifest(benchdata / "manifest.jsonl"))
    return conversations.build("two readers", ("lj", "austen"), pool, 45.0, overlap=False, seed=5)


def _wav(audio: np.ndarray) -> bytes:
    out = io.BytesIO()
    sf.write(out, audio, SR, format="WAV", subtype="PCM_16")
    return out.getvalue()


def _data_url(audio: np.ndarray) -> str:
    return "data:audio/wav;base64," + base64.b64encode(_wav(audio)).decode()


def _studio_data_url(audio: np.ndarray) -> str:
    """A reference as a recorder makes it: 48 kHz stereo WAV (its data URL is over a form field's usual 1 MB)."""
    out = io.BytesIO()
    sf.write(out, np.repeat(soxr.resample(audio, SR, 48000)[:, None], 2, axis=1), 48000, format="WAV", subtype="PCM_16")
    return "data:audio/x-wav;base64," + base64.b64encode(out.getvalue()).decode()


def _error_rate(talk: conversations.Conversation, segments: list[dict[str, object]]) -> float:
    reference, hypothesis = Annotation(), Annotation()
    for k, turn in enumerate(talk.turns):
        reference[Span(turn.start, turn.end), k] = turn.speaker
    for k, s in enumerate(segments):
        hypothesis[Span(float(s["start"]), float(s["end"])), k] = s["speaker"]  # type: ignore[arg-type]
    return float(DiarizationErrorRate(collar=0.5)(reference, hypothesis))


def test_diarized_json_says_who_spoke_and_changes_no_word(client: OpenAI, talk: conversations.Conversation) -> None:
    audio = ("talk.wav", _wav(talk.audio))
    plain = client.audio.transcriptions.create(
        model="whisper-1", file=audio, response_format="json", chunking_strategy="auto"
    )
    diarized = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="diarized_json")
    assert diarized.task == "transcribe" and diarized.text == plain.text  # diarization changes no word
    assert abs(diarized.duration - talk.seconds) < 0.05
    assert diarized.usage is not None and diarized.usage.type == "duration"
    segments = diarized.segments
    assert [s.id for s in segments] == [f"seg_{k}" for k in range(len(segments))]
    assert all(s.type == "transcript.text.segment" and s.text and s.start <= s.end for s in segments)
    assert " ".join(s.text for s in segments).split() == diarized.text.split()  # every word, once, in order
    assert next(s.speaker for s in segments) == "A" and {s.speaker for s in segments} == {"A", "B"}
    assert all(a.start <= b.start for a, b in itertools.pairwise(segments))
    assert _error_rate(talk, [s.model_dump() for s in segments]) < 0.15

    # Bounds on the number of speakers (WhisperX's fields): one speaker, however many voices.
    one = client.audio.transcriptions.create(
        model="whisper-1", file=audio, response_format="diarized_json", extra_body={"max_speakers": 1}
    )
    assert {s.speaker for s in one.segments} == {"A"} and one.text == plain.text


def test_known_speakers_are_named_by_their_references(client: OpenAI, talk: conversations.Conversation) -> None:
    diarized = client.audio.transcriptions.create(
        model="whisper-1",
        file=("talk.flac", _wav(talk.audio)),
        response_format="diarized_json",
        chunking_strategy="auto",
        known_speaker_names=["Linda"],
        known_speaker_references=[_studio_data_url(talk.references["lj"])],
    )
    speakers = {s.speaker for s in diarized.segments}
    assert speakers == {"Linda", "A"}  # the other voice, unnamed, gets the first letter
    named = {"lj": "Linda", "austen": "A"}
    right = sum(
        min(s.end, t.end) - max(s.start, t.start)
        for s in diarized.segments
        for t in talk.turns
        if s.speaker == named[t.speaker] and min(s.end, t.end) > max(s.start, t.start)
    )
    assert right / sum(t.end - t.start for t in talk.turns) > 0.85


def test_streamed_segments_carry_their_speakers(server: ServerProcess, talk: conversations.Conversation) -> None:
    events = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "response_format": "diarized_json", "stream": "true"},
        files={"file": ("talk.wav", _wav(talk.audio))},
        timeout=300,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "transcript.text.delta" and kinds[-1] == "transcript.text.done"
    first_segment = kinds.index("transcript.text.segment")
    assert set(kinds[first_segment:-1]) == {"transcript.text.segment"}  # once speakers are final: after the text
    segments = [e for e in events if e["type"] == "transcript.text.segment"]
    assert {s["speaker"] for s in segments} == {"A", "B"}
    assert " ".join(s["text"] for s in segments).split() == events[-1]["text"].split()
    assert "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta").strip() == events[-1]["text"]


def test_verbose_json_with_diarize_gives_segments_and_words_speakers(
    server: ServerProcess, talk: conversations.Conversation
) -> None:
    response = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={
            "model": "whisper-1",
            "response_format": "verbose_json",
            "diarize": "true",
            "timestamp_granularities[]": ["word", "segment"],
        },
        files={"file": ("talk.wav", _wav(talk.audio))},
        timeout=300,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert {s["speaker"] for s in body["segments"]} == {"A", "B"}
    assert body["words"] and {w["speaker"] for w in body["words"]} == {"A", "B"}


def test_what_a_diarized_request_may_not_ask(client: OpenAI, talk: conversations.Conversation) -> None:
    """OpenAI's refusals, each a 400 naming its parameter."""
    audio = ("talk.wav", _wav(talk.audio[: 8 * SR]))
    ref = _data_url(talk.references["lj"])

    def refused(param: str, **fields: object) -> None:
        fields = {"model": "whisper-1", "file": audio, "response_format": "diarized_json", **fields}
        with pytest.raises(BadRequestError) as caught:
            client.audio.transcriptions.create(**fields)  # type: ignore[call-overload]
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]

    refused("known_speaker_names[]", known_speaker_names=list("abcde"), known_speaker_references=[ref] * 5)
    refused("known_speaker_references[]", known_speaker_names=["a", "b"], known_speaker_references=[ref])
    refused("known_speaker_references[]", known_speaker_names=["a"], known_speaker_references=["not a data URL"])
    short = _data_url(talk.references["lj"][:SR])  # 1 s
    refused("known_speaker_references[]", known_speaker_names=["a"], known_speaker_references=[short])
    long = _data_url(np.tile(talk.references["lj"], 3))  # 15 s
    refused("known_speaker_references[]", known_speaker_names=["a"], known_speaker_references=[long])
    noise = "data:audio/wav;base64," + base64.b64encode(b"not audio at all" * 100).decode()
    refused("known_speaker_references[]", known_speaker_names=["a"], known_speaker_references=[noise])
    refused("timestamp_granularities[]", timestamp_granularities=["word"])
    refused("include[]", include=["logprobs"])
    refused("min_speakers", extra_body={"min_speakers": 3, "max_speakers": 2})
    refused("max_speakers", extra_body={"max_speakers": 0})

    none = httpx.post(  # the SDK's chunking_strategy takes "auto" or an object only
        f"{client.base_url}audio/transcriptions",
        data={"model": "whisper-1", "response_format": "diarized_json", "chunking_strategy": "none"},
        files={"file": audio},
        timeout=60,
    )
    assert none.status_code == 400 and none.json()["error"]["param"] == "chunking_strategy"
    with pytest.raises(BadRequestError) as caught:
        client.audio.translations.create(model="whisper-1", file=audio, response_format="diarized_json")  # type: ignore[arg-type]
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(BadRequestError) as caught:  # speaker fields on an answer that names no speakers
        client.audio.transcriptions.create(
            model="whisper-1", file=audio, known_speaker_names=["a"], known_speaker_references=[ref]
        )
    assert caught.value.body["param"] == "known_speaker_names[]"  # type: ignore[index]


def test_a_live_session_names_the_same_voice_the_same_across_turns(server: ServerProcess, benchdata: Path) -> None:
    """Opt-in (`input_audio_transcription.diarize`): each completed turn carries the speaker of its voice."""
    pool = conversations.voices(read_manifest(benchdata / "manifest.jsonl"))
    said = ["lj", "austen", "lj", "austen", "austen", "lj"]
    url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"type": "transcription_session.update", "session": {
            "input_audio_sample_rate": 16000, "turn_detection": None,
            "input_audio_transcription": {"model": "whisper-1", "language": "en", "diarize": True}}}))  # fmt: skip
        for voice in said:
            pcm = (np.clip(pool[voice].turn(4.0)[0], -1, 1) * 32767).astype("<i2").tobytes()
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
            ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        updated, completed = None, []
        while len(completed) < len(said):
            event = json.loads(ws.recv(timeout=180))
            assert event["type"] != "error", event
            if event["type"] == "transcription_session.updated":
                updated = event["session"]
            elif event["type"] == "conversation.item.input_audio_transcription.completed":
                completed.append(event)
    assert updated is not None and updated["input_audio_transcription"]["diarize"] is True
    assert [e["speaker"] for e in completed] == ["A", "B", "A", "B", "B", "A"]
    assert all(e["transcript"] for e in completed)


def _same_voice_embedder(folder: Path) -> Path:
    """An ONNX embedder that hears every window as the same voice: [batch, samples] -> [batch, 8] constant."""

    class Same(torch.nn.Module):
        def forward(self, audio: torch.Tensor) -> torch.Tensor:
            return audio[:, :8] * 0 + torch.arange(1.0, 9.0)

    path = folder / "same.onnx"
    torch.onnx.export(
        Same(), (torch.randn(2, SR),), str(path), input_names=["audio"], output_names=["embedding"],
        dynamic_axes={"audio": {0: "batch", 1: "samples"}, "embedding": {0: "batch"}}, dynamo=False,
    )  # fmt: skip
    return path


onnx_server = server_fixture(
    lambda factory: {"SPECWHISPER_SPEAKER_EMBEDDER": str(_same_voice_embedder(factory.mktemp("embedder")))},
    name="onnx-embedder-server",
)


def test_the_operators_onnx_embedder_is_the_one_heard(
    onnx_server: ServerProcess, talk: conversations.Conversation
) -> None:
    """With an embedder that hears one voice everywhere, two readers are one speaker: its prints were used."""
    answer = openai_client(onnx_server).audio.transcriptions.create(
        model="whisper-1", file=("talk.wav", _wav(talk.audio)), response_format="diarized_json"
    )
    assert answer.segments and {s.speaker for s in answer.segments} == {"A"}
