"""The benchmark's reference decoders run the same weights and agree with the engine's main-only greedy."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from app.api.types import DecodingOptions
from app.engine.engine import Engine
from app.model.whisper import WhisperModel
from app.tools.comparisons import FasterWhisper, HFGenerate

pytestmark = pytest.mark.slow  # not in the quick tier: transformers and faster-whisper decode real clips

CLIP = "whisper/jfk"


def _engine_tokens(base: WhisperModel, audio: np.ndarray) -> list[int]:
    return Engine(base).transcribe([audio], [DecodingOptions(language="en", use_assistant=False)])[0].tokens


def test_hf_generate_plain_and_assisted_match_the_engine(base: WhisperModel, clip: Callable[[str], np.ndarray]) -> None:
    audio = clip(CLIP)
    expected = _engine_tokens(base, audio)
    for assisted in (False, True):
        result = HFGenerate(base, assisted=assisted).run(audio, "en")
        assert result.tokens == expected
        assert result.total_ms > 0 and "country" in result.text


def test_faster_whisper_on_the_same_weights_matches_the_engine(
    base: WhisperModel, clip: Callable[[str], np.ndarray]
) -> None:
    pytest.importorskip("faster_whisper")
    audio = clip(CLIP)
    result = FasterWhisper(base, threads=2).run(audio, "en")
    assert result.tokens == _engine_tokens(base, audio)
