"""Long-form uploads against the reference: openai-whisper's `transcribe()` on the same weights (our converted
checkpoint, loaded into its model) gives the same segments as the server's verbose_json, speculative and
main-only, at the API's temperature 0 (the fallback ladder), with word timestamps and the reference's
hallucination defences."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.api.types import FALLBACK_TEMPERATURES, Segment
from app.store.catalog import ModelStore
from app.tools.manifest import ManifestClip
from app.tools.reference import compare_segments, load_reference, reference_transcribe
from tests.server import ServerProcess, metric, openai_client, server_fixture
from tests.test_chunking import _wav

pytestmark = pytest.mark.slow
SR = 16000

server = server_fixture({"SPECWHISPER_SPECULATION": "always"})


@pytest.fixture(scope="module")
def reference(store: ModelStore) -> Any:
    return load_reference(store.path("whisper-base"))


@pytest.fixture(scope="module")
def recordings(manifest: dict[str, ManifestClip], clip: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Three long recordings: a read chapter (229 s); English clips between pauses of 1 to 7 s and a stretch
    of noise (146 s); German clips one after another (111 s), whose language is detected."""
    clips = list(manifest.values())
    english = [c for c in clips if c.language == "en" and c.subset == "short"][20:32]
    rng = np.random.default_rng(0)
    parts = []
    for i, c in enumerate(english):
        parts += [clip(c.id), np.zeros(int(SR * (1 + 3 * (i % 3))), np.float32)]
        if i == 5:
            parts.append(rng.normal(0, 0.05, SR * 8).astype(np.float32))
    german = [c for c in clips if c.language == "de"][:8]
    return {
        "chapter": clip("ljspeech_longform/LJ001-0001_to_LJ001-0032"),
        "meeting": np.concatenate(parts),
        "german": np.concatenate([x for c in german for x in (clip(c.id), np.zeros(SR, np.float32))]),
    }


def _segments(body: dict[str, Any]) -> list[Segment]:
    keys = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio")
    return [Segment(**{k: s[k] for k in keys}, no_speech_prob=s["no_speech_prob"]) for s in body["segments"]]


def _word_problems(body: dict[str, Any], expected: dict[str, Any], duration: float) -> list[str]:
    """Where the response's words differ from the reference's (text, and times within 0.01 s)."""
    theirs = [w for s in expected["segments"] if s["text"].strip() for w in s["words"]]
    ours = body["words"]
    problems = [] if len(ours) == len(theirs) else [f"{len(ours)} words, the reference has {len(theirs)}"]
    for w, v in zip(ours, theirs, strict=False):
        same_times = all(abs(w[k] - min(v[k], duration)) <= 0.01 for k in ("start", "end"))
        if w["word"] != v["word"].strip() or not same_times:
            problems.append(f"{w} != {v}")
    return problems


def _transcribe(server: ServerProcess, audio: np.ndarray, speculative: bool, words: bool, **fields: str) -> Any:
    data = {"model": "whisper-1", "response_format": "verbose_json", "speculative": str(speculative).lower()}
    data |= {"timestamp_granularities[]": "word"} if words else {}
    response = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data=data | fields,
        files={"file": ("a.wav", _wav(audio))},
        timeout=600,
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name", ["chapter", "meeting", "german"])
def test_segments_equal_the_reference(
    server: ServerProcess, reference: Any, recordings: dict[str, np.ndarray], name: str
) -> None:
    audio = recordings[name]
    expected = reference_transcribe(reference, audio, temperature=FALLBACK_TEMPERATURES)
    # main-only on the chapter too (the engine's tests hold both modes' long-form tokens equal on the rest)
    for speculative in (True, False) if name == "chapter" else (True,):
        body = _transcribe(server, audio, speculative, words=False)
        assert body["language"] == ("german" if name == "german" else "english")  # OpenAI gives the name
        problems = compare_segments(_segments(body), expected["segments"], audio.size / SR)
        assert not problems, (speculative, problems[:5])
        assert all(s["end"] <= body["duration"] for s in body["segments"])


def test_words_and_hallucination_defences_equal_the_reference(
    server: ServerProcess, reference: Any, recordings: dict[str, np.ndarray]
) -> None:
    audio = recordings["meeting"]
    duration = audio.size / SR
    cases: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({"word_timestamps": True}, {}),
        ({"word_timestamps": True, "hallucination_silence_threshold": 2.0}, {"hallucination_silence_threshold": "2"}),
        (
            {"clip_timestamps": "10,70,100", "condition_on_previous_text": False, "no_speech_threshold": 0.5},
            {"clip_timestamps": "10,70,100", "condition_on_previous_text": "false", "no_speech_threshold": "0.5"},
        ),
    ]
    for options, fields in cases:
        expected = reference_transcribe(reference, audio, temperature=FALLBACK_TEMPERATURES, **options)
        words = bool(options.get("word_timestamps"))
        body = _transcribe(server, audio, True, words=words, **fields)
        problems = compare_segments(_segments(body), expected["segments"], duration)
        if words:
            problems += _word_problems(body, expected, duration)
        assert not problems, (options, problems[:5])
        if "clip_timestamps" in options:
            assert body["segments"][0]["start"] >= 10 and all(
                not (70 < s["start"] < 100 - 0.5) for s in body["segments"]
            )


def test_beam_search_equals_the_reference(
    server: ServerProcess,
    reference: Any,
    recordings: dict[str, np.ndarray],
    manifest: dict[str, ManifestClip],
    clip: Callable[[str], np.ndarray],
) -> None:
    """Beam search through the API (the official SDK's extra form fields) gives openai-whisper's
    `transcribe(beam_size=5, best_of=5)` segments on the read chapter's first minute (three windows; greedy
    long-form has the whole chapter in test_segments_equal_the_reference) and four short clips, speculative (that
    speculative beam search gives plain beam search's tokens, long-form too, is test_beam's); the answer's metrics
    say beam search ran."""
    sdk = openai_client(server)
    short = [c.id for c in manifest.values() if c.language == "en" and c.subset == "short"][40:44]
    cases = {"chapter": recordings["chapter"][: 60 * SR], **{c: clip(c) for c in short}}
    for name, audio in cases.items():
        expected = reference_transcribe(reference, audio, beam_size=5, best_of=5, temperature=FALLBACK_TEMPERATURES)
        response = sdk.audio.transcriptions.create(
            model="whisper-1",
            file=("a.wav", _wav(audio)),
            response_format="verbose_json",
            extra_body={"beam_size": 5, "best_of": 5, "speculative": True},
        )
        body = response.model_dump()
        assert body["metrics"]["decoding"] == "beam" and body["metrics"]["beam_size"] == 5
        assert body["metrics"]["speculative"]
        assert name != "chapter" or len({s["seek"] for s in body["segments"]}) >= 2  # long-form: several windows
        problems = compare_segments(_segments(body), expected["segments"], audio.size / SR)
        assert not problems, (name, problems[:5])
    # Prometheus has each decoding's tokens and main passes (their ratio: tokens per main pass).
    assert metric(server, "specwhisper_main_passes_total", decoding="beam") > 0
    assert metric(server, "specwhisper_decoded_tokens_total", decoding="beam") > 0


def test_long_form_fields_are_validated(server: ServerProcess, recordings: dict[str, np.ndarray]) -> None:
    short = _wav(recordings["chapter"][: 2 * SR])
    cases = {
        "condition_on_previous_text": "maybe",
        "compression_ratio_threshold": "high",
        "logprob_threshold": "1",
        "no_speech_threshold": "nan",
        "hallucination_silence_threshold": "-2",
        "clip_timestamps": "5,2",
        "beam_size": "five",
        "best_of": "0",
        "patience": "2",  # without beam search
        "length_penalty": "9",
    }
    for name, value in cases.items():
        response = httpx.post(
            f"{server.url}/v1/audio/transcriptions",
            data={"model": "whisper-1", name: value},
            files={"file": ("a.wav", short)},
            timeout=60,
        )
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name, response.text
    ok = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        data={"model": "whisper-1", "logprob_threshold": "none", "compression_ratio_threshold": "null"},
        files={"file": ("a.wav", short)},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["text"].startswith("Printing")


def test_reference_model_is_our_checkpoint(store: ModelStore, reference: Any) -> None:
    """The reference really runs our weights: its first decoder layer's query weight is ours."""
    from safetensors.torch import load_file

    ours = load_file(Path(store.path("whisper-base")) / "model.safetensors")
    theirs = reference.decoder.blocks[0].attn.query.weight.detach()
    assert np.array_equal(ours["model.decoder.layers.0.self_attn.q_proj.weight"].float().numpy(), theirs.numpy())
