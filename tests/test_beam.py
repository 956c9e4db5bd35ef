"""Beam search: openai-whisper's semantics, and speculative beam search gives plain beam search's output token for
token, with the int8 self-draft and with a draft that is often wrong, on short clips, long-form audio with
timestamps and batches that mix beam, greedy and sampling requests. (The server's beam search against
openai-whisper's long-form `transcribe()` is in test_reference.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from app.api.types import DecodingOptions, InvalidRequestError, Transcription
from app.engine.drafting.assistants import self_draft
from app.engine.engine import Engine
from app.model.whisper import WhisperModel
from app.store.catalog import ModelStore
from app.tools.reference import compare_segments, load_reference, reference_transcribe
from tests.drafts import noisy_self_draft

pytestmark = pytest.mark.slow
SR = 16000
SHORT = ("whisper/jfk", "ljspeech/LJ001-0001", "ljspeech/LJ001-0003", "fleurs/fleurs-de-001")


def _fields(t: Transcription) -> list[tuple[Any, ...]]:
    """Everything a request gets back of its segments, compared exactly."""
    return [(s.tokens, s.start, s.end, s.avg_logprob, s.temperature, s.no_speech_prob) for s in t.segments]


@pytest.fixture(scope="module")
def long_audio(clip: Callable[[str], np.ndarray]) -> np.ndarray:
    """About 70 s of read speech with pauses: three windows, conditioned on the previous text."""
    ids = ["ljspeech/LJ001-0001", "ljspeech/LJ001-0002", "ljspeech/LJ001-0003", "ljspeech/LJ001-0004",
           "ljspeech/LJ001-0005", "ljspeech/LJ001-0006", "ljspeech/LJ001-0007", "ljspeech/LJ001-0008",
           "ljspeech/LJ001-0009", "ljspeech/LJ001-0010"]  # fmt: skip
    return np.concatenate([x for i in ids for x in (clip(i), np.zeros(SR // 2, np.float32))])


def test_beam_options_are_validated() -> None:
    for bad in (
        {"beam_size": 0},
        {"beam_size": 17},
        {"best_of": 0},
        {"patience": 2.0},  # patience needs beam search
        {"beam_size": 5, "patience": 0.0},
        {"beam_size": 5, "length_penalty": 3.0},
    ):
        with pytest.raises(InvalidRequestError) as error:
            DecodingOptions(**bad)
        assert error.value.param == next(iter(bad.keys() - {"beam_size"}), "beam_size")
    options = DecodingOptions(beam_size=5)
    assert options.decoding == "beam" and options.candidates == 5
    assert DecodingOptions().candidates == 1 and DecodingOptions(beam_size=5, best_of=2).candidates == 2


def test_beam_search_is_openai_whispers(
    base: WhisperModel, store: ModelStore, clip: Callable[[str], np.ndarray]
) -> None:
    """Our beam search gives openai-whisper's segments on the same weights with its options: patience above 1 (more
    finished candidates), a length penalty (the Google NMT ranker), and a beam of 3; and beam 5 differs from greedy
    decoding somewhere (else this would test nothing)."""
    reference = load_reference(store.path("whisper-base"))
    engine = Engine(base)
    differs = False
    for clip_id, options in [
        ("ljspeech/LJ001-0001", {"beam_size": 5, "patience": 2.0}),
        ("ljspeech/LJ001-0003", {"beam_size": 3, "length_penalty": 0.6}),
        ("fleurs/fleurs-de-001", {"beam_size": 5}),
    ]:
        audio = clip(clip_id)
        language = "de" if "-de-" in clip_id else "en"
        ours = engine.transcribe([audio], [DecodingOptions(language=language, timestamps="segment", **options)])[0]
        theirs = reference_transcribe(reference, audio, language=language, temperature=0.0, **options)
        assert ours.metrics.decoding == "beam" and ours.metrics.beam_size == options["beam_size"]
        assert not compare_segments(ours.segments, theirs["segments"], audio.size / SR), clip_id
        greedy = engine.transcribe([audio], [DecodingOptions(language=language, timestamps="segment")])[0]
        differs |= _fields(greedy) != _fields(ours)
    assert differs


def test_speculative_beam_search_equals_plain_beam_search(
    base: WhisperModel, clip: Callable[[str], np.ndarray], long_audio: np.ndarray
) -> None:
    """With the int8 self-draft: the same segments, tokens and log-probabilities as plain beam search, in fewer main
    passes, on short clips (with and without timestamps) and on long-form audio."""
    engine = Engine(base, self_draft(base))
    cases = [(clip(c), DecodingOptions(language="de" if "-de-" in c else "en", beam_size=5)) for c in SHORT]
    cases.append((clip("whisper/jfk"), DecodingOptions(language="en", beam_size=5, timestamps="segment")))
    cases.append((long_audio, DecodingOptions(language="en", beam_size=5)))
    saved = 0
    for audio, options in cases:
        plain = engine.transcribe([audio], [DecodingOptions(**{**options.__dict__, "use_assistant": False})])[0]
        spec = engine.transcribe([audio], [options])[0]
        assert spec.metrics.speculative and not plain.metrics.speculative
        assert spec.tokens == plain.tokens and _fields(spec) == _fields(plain)
        saved += plain.metrics.main_passes - spec.metrics.main_passes
        assert spec.metrics.draft_accepted <= spec.metrics.draft_proposed
    assert saved > 0 and len(long_audio) / SR > 60


def test_a_wrong_draft_changes_nothing_in_a_mixed_batch(base: WhisperModel, clip: Callable[[str], np.ndarray]) -> None:
    """A draft that is often wrong (noisy weights) in a batch mixing beam searches of two widths (one with patience),
    a greedy request and a sampling one with three candidates: each request gets what it gets alone without drafts."""
    noisy = Engine(base, noisy_self_draft(base, sigma=0.3))
    plain = Engine(base)
    audio = [clip(c) for c in ("whisper/jfk", "ljspeech/LJ001-0001", "ljspeech/LJ001-0003", "ljspeech/LJ001-0002")]
    options = [
        DecodingOptions(language="en", beam_size=5),
        DecodingOptions(language="en"),
        DecodingOptions(language="en", beam_size=3, patience=2.0, timestamps="segment"),
        DecodingOptions(language="en", temperature=0.7, best_of=3),
    ]
    batch = noisy.transcribe(audio, options)
    rejected = 0
    for a, o, got in zip(audio, options, batch, strict=True):
        alone = plain.transcribe([a], [DecodingOptions(**{**o.__dict__, "use_assistant": False})])[0]
        assert got.tokens == alone.tokens and _fields(got) == _fields(alone), o
        rejected += got.metrics.draft_proposed - got.metrics.draft_accepted
    assert rejected > 0


def test_best_of_keeps_the_best_ranked_sample(base: WhisperModel, clip: Callable[[str], np.ndarray]) -> None:
    """Above temperature 0, best_of samples compete: the one kept ranks first (sum of log-probabilities over
    length) among the samples drawn alone with the same noise, and best_of=1 draws the first of them."""
    engine = Engine(base)
    audio = clip("pocketsphinx/goforward")
    one = engine.transcribe([audio], [DecodingOptions(language="en", temperature=1.0)])[0]
    five = engine.transcribe([audio], [DecodingOptions(language="en", temperature=1.0, best_of=5)])[0]
    again = engine.transcribe([audio], [DecodingOptions(language="en", temperature=1.0, best_of=5)])[0]
    assert five.tokens == again.tokens  # the same request draws the same samples
    score = five.segments[0].avg_logprob * (len(five.tokens) + 1) / max(len(five.tokens), 1)
    first = one.segments[0].avg_logprob * (len(one.tokens) + 1) / max(len(one.tokens), 1) if one.segments else -1e9
    assert score >= first
