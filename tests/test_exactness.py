"""Speculative decoding returns exactly the main model's greedy tokens, whatever the draft."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from app.engine.assistant import model_draft, self_draft
from app.engine.draft import Drafter
from app.engine.model import WhisperModel
from app.engine.transcriber import DecodingOptions, Engine
from app.store.catalog import ModelStore
from app.store.loader import load_model
from tests.drafts import (
    decoder_only_checkpoint,
    noisy_encoder_checkpoint,
    noisy_self_draft,
    random_tiny_checkpoint,
)

# Up to 30 s each, five languages, short and long utterances.
CLIPS = {
    "whisper/jfk": "en",
    "ljspeech/LJ001-0001": "en",
    "pocketsphinx/goforward": "en",
    "fleurs/fleurs-de-001": "de",
    "fleurs/fleurs-es-002": "es",
    "fleurs/fleurs-fr-002": "fr",
    "fleurs/fleurs-pt-002": "pt",
}


@pytest.fixture(scope="module")
def greedy(base: WhisperModel, clip: Callable[[str], np.ndarray]) -> dict[str, list[int]]:
    """Main-only greedy tokens of every clip: the reference."""
    engine = Engine(base)
    out = {}
    for clip_id, lang in CLIPS.items():
        result = engine.transcribe([clip(clip_id)], [DecodingOptions(language=lang)])[0]
        assert result.metrics.draft_proposed == 0 and not result.metrics.speculative
        assert result.metrics.main_passes == result.metrics.tokens + 1  # one pass per token, plus end-of-text
        out[clip_id] = result.tokens
    return out


def _speculative(engine: Engine, clip: Callable[[str], np.ndarray]) -> tuple[dict[str, list[int]], float]:
    tokens, drafted, accepted = {}, 0, 0
    for clip_id, lang in CLIPS.items():
        result = engine.transcribe([clip(clip_id)], [DecodingOptions(language=lang)])[0]
        assert result.metrics.speculative
        tokens[clip_id] = result.tokens
        drafted += result.metrics.draft_proposed
        accepted += result.metrics.draft_accepted
    return tokens, accepted / drafted


def test_greedy_matches_transformers_generate(
    base: WhisperModel, base_dir: Path, greedy: dict[str, list[int]], clip: Callable[[str], np.ndarray]
) -> None:
    """The engine's main-only path is real Whisper greedy decoding (same tokens as transformers)."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32).eval()
    fe = WhisperFeatureExtractor.from_pretrained(base_dir)
    for clip_id in ("whisper/jfk", "fleurs/fleurs-de-001"):
        features = fe(clip(clip_id), sampling_rate=16000, return_tensors="pt").input_features
        out = hf.generate(features, language=CLIPS[clip_id], task="transcribe")
        ids = [t for t in out[0].tolist() if t < base.tokenizer.eot]
        assert ids == greedy[clip_id]
    assert "ask not what your country can do for you" in base.tokenizer.decode(greedy["whisper/jfk"]).lower()


def test_self_draft_is_exact(base: WhisperModel, greedy: dict[str, list[int]], clip: Callable) -> None:
    tokens, acceptance = _speculative(Engine(base, self_draft(base)), clip)
    assert tokens == greedy
    assert acceptance > 0.5  # an int8 copy agrees with the main model most of the time


@pytest.fixture(scope="module")
def weak_drafts(base: WhisperModel, store: ModelStore, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Drafter]:
    tmp = tmp_path_factory.mktemp("drafts")
    src = Path(base.source)
    decoder_only = load_model(str(decoder_only_checkpoint(src, tmp / "decoder-only", 0.3)), store, progress=False)
    enc_dec = load_model(str(noisy_encoder_checkpoint(src, tmp / "enc-dec", 0.2)), store, progress=False)
    drafts = {
        "noisy-self-draft": noisy_self_draft(base, 0.3),
        "decoder-only": model_draft(base, decoder_only),
        "encoder-decoder": model_draft(base, enc_dec),
    }
    assert drafts["decoder-only"].cross == "main-encoder"
    assert drafts["encoder-decoder"].cross == "own-encoder"
    return drafts


@pytest.mark.parametrize("kind", ["noisy-self-draft", "decoder-only", "encoder-decoder"])
def test_weak_drafts_are_exact(
    kind: str,
    weak_drafts: dict[str, Drafter],
    base: WhisperModel,
    greedy: dict[str, list[int]],
    clip: Callable,
) -> None:
    tokens, acceptance = _speculative(Engine(base, weak_drafts[kind]), clip)
    assert 0.1 <= acceptance <= 0.9, f"{kind}: acceptance {acceptance:.2f} does not exercise rejections"
    assert tokens == greedy


def test_random_init_draft_is_exact(
    base: WhisperModel, store: ModelStore, greedy: dict[str, list[int]], clip: Callable, tmp_path: Path
) -> None:
    random = load_model(str(random_tiny_checkpoint(Path(base.source), tmp_path / "rand")), store, progress=False)
    tokens, acceptance = _speculative(Engine(base, model_draft(base, random)), clip)
    assert acceptance < 0.1
    assert tokens == greedy


@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
def test_fixed_draft_lengths_are_exact(
    draft_tokens: int, base: WhisperModel, greedy: dict[str, list[int]], clip: Callable
) -> None:
    from app.engine.draft import DraftLength

    length = DraftLength(initial=draft_tokens, maximum=max(draft_tokens, 1), adaptive=False)
    tokens, _ = _speculative(Engine(base, noisy_self_draft(base, 0.3, length=length)), clip)
    assert tokens == greedy


def test_length_limit_is_exact(base: WhisperModel, clip: Callable) -> None:
    """max_new_tokens cuts both modes at the same token, mid-draft."""
    audio = clip("ljspeech/LJ001-0001")
    for limit in (1, 7, 12):
        opts = [DecodingOptions(language="en", max_new_tokens=limit, use_assistant=u) for u in (False, True)]
        engine = Engine(base, self_draft(base))
        plain, spec = (engine.transcribe([audio], [o])[0] for o in opts)
        assert len(plain.tokens) == limit and plain.finish == "length"
        assert spec.tokens == plain.tokens and spec.finish == "length"
