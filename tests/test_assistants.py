"""Assistant selection: vocabulary checks, batches, per-request opt-out."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from app.api.types import DecodingOptions, InvalidRequestError
from app.engine.build import build_engine
from app.engine.drafting.assistants import model_draft, same_encoder, self_draft
from app.engine.engine import Engine
from app.model.tokenizer import VocabularyMismatchError
from app.model.whisper import WhisperModel
from app.settings import Settings
from app.store.catalog import ModelStore
from app.store.loader import load_model

pytestmark = pytest.mark.slow  # not in the quick tier: loads and decodes with several assistant models


def test_mismatched_vocabulary_fails_at_startup_naming_both() -> None:
    with pytest.raises(VocabularyMismatchError) as err:
        build_engine(Settings(model="whisper-base", assistant="whisper-tiny.en"), progress=False)
    message = str(err.value)
    assert "whisper-tiny.en" in message and "whisper-base" in message
    assert "51864 tokens, English-only" in message and "51865 tokens, multilingual" in message


def test_batch_rows_equal_single_requests(base: WhisperModel, clip: Callable) -> None:
    """Rows of different lengths and languages decoded together equal their single-request greedy tokens."""
    engine = Engine(base, self_draft(base))
    ids = [("fleurs/fleurs-de-001", "de"), ("pocketsphinx/goforward", "en"), ("whisper/jfk", "en")]
    audio = [clip(i) for i, _ in ids]
    single = [
        engine.transcribe([a], [DecodingOptions(language=lang, use_assistant=False)])[0]
        for a, (_, lang) in zip(audio, ids, strict=True)
    ]
    opts = [DecodingOptions(language=lang, use_assistant=i != 1) for i, (_, lang) in enumerate(ids)]
    batch = engine.transcribe(audio, opts)
    assert [r.tokens for r in batch] == [r.tokens for r in single]
    assert batch[1].metrics.draft_proposed == 0 and not batch[1].metrics.speculative
    assert batch[0].metrics.draft_proposed > 0 and batch[0].metrics.batch_size == 3


def test_language_detection_and_bad_options(base: WhisperModel, clip: Callable) -> None:
    engine = Engine(base)
    results = engine.transcribe([clip("fleurs/fleurs-fr-002"), clip("whisper/jfk")], [DecodingOptions()] * 2)
    assert [r.language for r in results] == ["fr", "en"]
    assert all(r.language_probability is not None and r.language_probability > 0.5 for r in results)
    with pytest.raises(InvalidRequestError, match="unsupported language"):
        engine.transcribe([clip("whisper/jfk")], [DecodingOptions(language="xx")])
    with pytest.raises(InvalidRequestError, match="task"):
        DecodingOptions(task="summarize")


def test_an_assistant_shares_the_main_encoder_held_in_another_dtype(base: WhisperModel, store: ModelStore) -> None:
    """An encoder-decoder assistant with the main model's encoder reads the main encoder's output, also when one
    of the two holds it in bf16 (`encoder_dtype`): encoders are compared in the coarser dtype."""
    half = load_model("whisper-base", store, encoder_dtype=torch.bfloat16, progress=False)
    assert half.encoder is not None and base.encoder is not None
    assert same_encoder(base.encoder, half.encoder) and same_encoder(half.encoder, base.encoder)
    other = copy.deepcopy(half.encoder)
    with torch.no_grad():
        other.layers[0].fc1.weight[0, 0] += 0.5
    assert not same_encoder(base.encoder, other)
    assistant = load_model("whisper-base", store, progress=False)  # fp32 encoder: its own copy of the weights
    assert model_draft(half, assistant).cross == "main-encoder" and assistant.encoder is None
