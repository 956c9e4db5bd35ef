"""Speculative decoding returns exactly the main model's greedy tokens, whatever the draft."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.api.types import DecodingOptions, Transcription
from app.engine.decoding.batch import DecoderState, Row
from app.engine.drafting.assistants import model_draft, self_draft
from app.engine.drafting.base import Drafter, DraftInputs, Drafts
from app.engine.drafting.decoder import DecoderDrafter, DecoderDraftSession
from app.engine.engine import Engine
from app.engine.invariance import decoder_is_batch_invariant
from app.model.features import N_SAMPLES, log_mel, window
from app.model.native import cpu_runs_kernel
from app.model.whisper import WhisperModel
from app.store.catalog import ModelStore
from app.store.loader import load_model
from app.tools.bench import error_rate
from tests.conftest import needs_native
from tests.drafts import (
    decoder_only_checkpoint,
    noisy_encoder_checkpoint,
    noisy_self_draft,
    random_tiny_checkpoint,
)

pytestmark = pytest.mark.slow  # not in the quick tier: decodes real clips with every draft and with transformers

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
# For the variations of one drafter (its draft length; a random one): two languages, short and long.
FEW = ("whisper/jfk", "ljspeech/LJ001-0001", "fleurs/fleurs-de-001")


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


def _speculative(
    engine: Engine, clip: Callable[[str], np.ndarray], ids: Iterable[str] = CLIPS
) -> tuple[dict[str, list[int]], float]:
    tokens, drafted, accepted = {}, 0, 0
    for clip_id in ids:
        result = engine.transcribe([clip(clip_id)], [DecodingOptions(language=CLIPS[clip_id])])[0]
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
    tokens, acceptance = _speculative(Engine(base, model_draft(base, random)), clip, FEW)
    assert acceptance < 0.1
    assert tokens == {clip_id: greedy[clip_id] for clip_id in FEW}


@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
def test_fixed_draft_lengths_are_exact(
    draft_tokens: int, base: WhisperModel, greedy: dict[str, list[int]], clip: Callable
) -> None:
    from app.engine.drafting.base import DraftLength

    length = DraftLength(initial=draft_tokens, maximum=max(draft_tokens, 1), adaptive=False)
    tokens, _ = _speculative(Engine(base, noisy_self_draft(base, 0.3, length=length)), clip, FEW)
    assert tokens == {clip_id: greedy[clip_id] for clip_id in FEW}


def test_length_limit_is_exact(base: WhisperModel, clip: Callable) -> None:
    """max_new_tokens cuts both modes at the same token, mid-draft."""
    audio = clip("ljspeech/LJ001-0001")
    for limit in (1, 7, 12):
        opts = [DecodingOptions(language="en", max_new_tokens=limit, use_assistant=u) for u in (False, True)]
        engine = Engine(base, self_draft(base))
        plain, spec = (engine.transcribe([audio], [o])[0] for o in opts)
        assert len(plain.tokens) == limit and plain.finish == "length"
        assert spec.tokens == plain.tokens and spec.finish == "length"


# A previous-text prompt as long-form audio carries from window to window (> 32 tokens).
LONG_PROMPT = (
    "The earliest book printed with movable types, the Gutenberg, or forty-two line Bible of about 1455, "
    "has never been surpassed. Printing, then, for our purpose, may be considered as the art of making books."
)


class RecordingDrafter:
    """Passes a real drafter's sessions through, noting for each whether and when it adopted the main cache."""

    def __init__(self, inner: DecoderDrafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.sessions: list[dict[str, list[int] | int]] = []

    def start(self, inputs: DraftInputs) -> DecoderDraftSession:
        session = self.inner.start(inputs)
        record: dict[str, list[int] | int] = {"adopted_at": [], "first_drafted_from": []}
        self.sessions.append(record)
        inner_adopt, inner_candidates = session.adopt, session.get_candidates

        def adopt(main: DecoderState, rows: Sequence[Row]) -> None:
            record["adopted_at"] = list(main.fed)
            inner_adopt(main, rows)

        def get_candidates(rows: Sequence[Row], budgets: Sequence[int]) -> Drafts:
            if not record["first_drafted_from"]:
                record["first_drafted_from"] = list(session.state.fed)
            return inner_candidates(rows, budgets)

        session.adopt, session.get_candidates = adopt, get_candidates  # type: ignore[method-assign]
        return session


def test_a_self_draft_adopts_the_main_cache_of_a_long_prompt(base: WhisperModel, clip: Callable) -> None:
    """With a prompt of >= 32 tokens the self-draft takes the main model's keys/values of it after a first
    pass without drafts instead of prefilling it: the output stays main-only's, the draft starts past the
    prompt, and it agrees with the main model as often as when it prefills the prompt itself."""
    audio = [clip("ljspeech/LJ001-0001"), clip("whisper/jfk")]
    options = [DecodingOptions(language="en", prompt=LONG_PROMPT)] * 2
    reference = [r.tokens for r in Engine(base).transcribe(audio, options)]
    prompt_len = len(base.tokenizer.encode(" " + LONG_PROMPT.strip())) + 1 + 4  # sot_prev, text, sot sequence
    acceptance = {}
    for adopt in (True, False):
        recorder = RecordingDrafter(self_draft(base))
        if not adopt:
            recorder.inner.adopt_min_prompt = None
        results = [Engine(base, recorder).transcribe([a], [o])[0] for a, o in zip(audio, options, strict=True)]
        assert [r.tokens for r in results] == reference
        assert len(recorder.sessions) == 2
        for record in recorder.sessions:
            if adopt:
                assert record["adopted_at"] == [prompt_len]  # after the first pass: the prompt is in the cache
                assert record["first_drafted_from"] == [prompt_len]  # so drafting starts past it
            else:
                assert record["adopted_at"] == [] and record["first_drafted_from"] == [0]
        acceptance[adopt] = sum(r.metrics.draft_accepted for r in results) / sum(
            r.metrics.draft_proposed for r in results
        )
    assert acceptance[True] >= acceptance[False] - 0.05 and acceptance[True] > 0.8, acceptance


def test_weak_self_drafts_adopting_a_long_prompt_are_exact(base: WhisperModel, clip: Callable) -> None:
    audio = [clip(c) for c in ("ljspeech/LJ001-0001", "fleurs/fleurs-de-001")]
    options = [DecodingOptions(language=lang, prompt=LONG_PROMPT) for lang in ("en", "de")]
    reference = [r.tokens for r in Engine(base).transcribe(audio, options)]
    engine = Engine(base, noisy_self_draft(base, 0.3))
    batched = engine.transcribe(audio, options)  # one batch: rows with prompts of different lengths
    assert [r.tokens for r in batched] == reference
    assert all(r.metrics.draft_proposed > r.metrics.draft_accepted for r in batched)  # rejections happened


Runs = dict[bool, list[Transcription]]


def _modes_alone_and_batched(
    main: WhisperModel, drafter: Drafter, audio: list[np.ndarray], options: list[DecodingOptions]
) -> tuple[Runs, Runs]:
    """Each clip through main-only (False) and speculative (True) decoding, one by one and as one batch."""
    engines = {use: Engine(main, drafter if use else None) for use in (False, True)}
    alone = {
        use: [e.transcribe([a], [o])[0] for a, o in zip(audio, options, strict=True)] for use, e in engines.items()
    }
    return alone, {use: e.transcribe(audio, options) for use, e in engines.items()}


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, marks=needs_native("bfloat16"), id="bfloat16"),
        pytest.param(torch.float16, marks=needs_native("float16"), id="float16"),
    ],
)
def test_a_half_precision_main_model_drafts_with_an_fp32_self_draft(
    dtype: torch.dtype, store: ModelStore, clip: Callable
) -> None:
    """`dtype=bfloat16` (or float16) on a CPU: the int8 self-draft computes in fp32, reading the main model's
    half-precision keys/values, alone, batched and after adopting a prompt's cache. In half precision the main
    model's rounding depends on how many tokens a pass feeds, so a near-tie may go either way between the modes
    (docs/engine.md): the texts must agree, not every token."""
    main = load_model("whisper-base", store, dtype=dtype, progress=False)
    drafter = self_draft(main)
    assert main.decoder.dtype == dtype and drafter.decoder.dtype == torch.float32
    audio = [clip(c) for c in FEW]
    options = [DecodingOptions(language=CLIPS[c]) for c in FEW]
    options[1] = DecodingOptions(language="en", prompt=LONG_PROMPT)  # the draft adopts the main's cache
    alone, batched = _modes_alone_and_batched(main, drafter, audio, options)
    assert "ask not what your country can do for you" in alone[True][0].text.lower()
    for runs in (alone, batched):
        pairs = [(p.text, s.text, o.language or "en") for p, s, o in zip(runs[False], runs[True], options, strict=True)]
        assert error_rate(pairs) <= 0.05, pairs
        spec_runs = runs[True]
        assert all(r.metrics.speculative for r in spec_runs)
        acceptance = sum(r.metrics.draft_accepted for r in spec_runs) / sum(r.metrics.draft_proposed for r in spec_runs)
        assert acceptance > 0.5, acceptance  # the fp32 draft agrees with the half-precision main model


@needs_native("bfloat16")
def test_a_bfloat16_encoder_feeds_fp32_decoders_exactly(store: ModelStore, clip: Callable) -> None:
    """`encoder_dtype=bfloat16`: the encoder alone runs in bfloat16 (AMX CPUs run it several times faster) and its
    states reach the fp32 decoders as fp32; both modes read the same states, so the output is main-only's to the
    token, alone and batched."""
    main = load_model("whisper-base", store, encoder_dtype=torch.bfloat16, progress=False)
    assert main.encoder is not None and main.encoder.dtype == torch.bfloat16
    assert main.dtype == main.decoder.dtype == torch.float32
    assert main.encode(torch.zeros(1, main.n_mels, 3000)).dtype == torch.float32
    audio = [clip(c) for c in FEW]
    options = [DecodingOptions(language=CLIPS[c]) for c in FEW]
    alone, batched = _modes_alone_and_batched(main, self_draft(main), audio, options)
    assert "ask not what your country can do for you" in alone[False][0].text.lower()
    for runs in (alone, batched):
        assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]
        assert all(r.metrics.speculative and r.metrics.draft_accepted > 0 for r in runs[True])


@pytest.mark.skipif(not cpu_runs_kernel(), reason="int8 runs on this project's kernel")
def test_an_int8_main_model_is_exact_alone_and_batched(store: ModelStore, clip: Callable) -> None:
    """`dtype=int8`: the main model's linear layers in int8, its draft sharing them. Each row is quantized on its
    own and multiplied in integers, so the decoder stays batch-invariant (the warm-up's check says so) and
    speculative decoding gives int8 main-only's tokens, one clip at a time and four in a batch, in five languages."""
    main = load_model("whisper-base", store, int8=True, progress=False)
    drafter = self_draft(main)
    engine = Engine(main, drafter)
    engine.warm_up({1})
    assert engine.batch_invariant and engine.describe()["dtype"] == "int8"
    ids = ["whisper/jfk", "fleurs/fleurs-de-001", "fleurs/fleurs-es-002", "fleurs/fleurs-fr-002"]
    audio = [clip(c) for c in ids]
    options = [DecodingOptions(language=CLIPS[c]) for c in ids]
    alone, batched = _modes_alone_and_batched(main, drafter, audio, options)
    assert "ask not what your country can do for you" in alone[False][0].text.lower()
    for runs in (alone, batched):
        assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]
        assert all(r.metrics.speculative and r.metrics.draft_accepted > 0 for r in runs[True])
    assert [r.tokens for r in batched[False]] == [r.tokens for r in alone[False]]


@pytest.mark.skipif(not cpu_runs_kernel(), reason="the batch-invariant attention needs this project's kernel")
def test_a_verification_pass_gives_each_token_a_one_token_steps_bits(base: WhisperModel, clip: Callable) -> None:
    """Bit for bit, not only the same argmax: the main model's logits at every position are the same whether
    one token is fed per pass (plain decoding), a few at once (a verification pass) or in a ragged batch with
    other requests, so speculative decoding cannot break a near tie differently from plain decoding."""
    tok = base.tokenizer
    ids = ("whisper/jfk", "ljspeech/LJ001-0001", "fleurs/fleurs-de-001", "fleurs/fleurs-fr-002")
    features = torch.stack([window(log_mel(clip(c), base.n_mels, padding=N_SAMPLES), 0) for c in ids])
    cross = base.decoder.cross_kv(base.encode(features))
    prompts = [tok.prompt(CLIPS[c], "transcribe", timestamps=False) for c in ids]
    with torch.inference_mode():
        # each row alone, one token per pass, greedy on the raw logits
        alone: list[list[torch.Tensor]] = []
        tokens: list[list[int]] = []
        for row, prompt in enumerate(prompts):
            state = DecoderState.start(base.decoder, cross.select(torch.tensor([row])), 1)
            hidden, _ = state.feed([prompt])
            logits, fed = [base.decoder.logits(hidden[0, -1])], []
            for _ in range(24):
                fed.append(int(logits[-1].argmax()))
                hidden, _ = state.feed([[fed[-1]]])
                logits.append(base.decoder.logits(hidden[0, -1]))
            alone.append(logits)
            tokens.append(fed)
        # all rows in one batch, each feeding its own ragged chunks (0 to 7 tokens a pass)
        state = DecoderState.start(base.decoder, cross, len(ids))
        hidden, feed = state.feed(prompts)
        got = [[base.decoder.logits(hidden[r, n - 1])] for r, n in enumerate(feed.lengths)]
        done = [0] * len(ids)
        sizes = itertools.cycle([[1, 7, 0, 3], [5, 1, 2, 7], [2, 0, 7, 1], [7, 3, 1, 4]])
        while any(d < len(t) for d, t in zip(done, tokens, strict=True)):
            chunk = [t[d : d + n] for t, d, n in zip(tokens, done, next(sizes), strict=True)]
            hidden, feed = state.feed(chunk)
            logits = base.decoder.logits(hidden)  # every row and position in one product, as a pass does
            for r, n in enumerate(feed.lengths):
                got[r] += [logits[r, j] for j in range(n)]
                done[r] += n
    for row in range(len(ids)):
        assert len(got[row]) == len(alone[row])
        for position, (a, b) in enumerate(zip(alone[row], got[row], strict=True)):
            assert torch.equal(a, b), (ids[row], position, float((a - b).abs().max()))


def test_the_warm_up_checks_that_the_decoder_is_batch_invariant(base: WhisperModel) -> None:
    """The worker's warm-up checks, on the machine at hand, that a token's logits do not depend on how a pass
    feeds it, and says so in `describe()`; a decoder whose output moves with the tokens a pass feeds fails."""
    engine = Engine(base)
    assert engine.describe()["batch_invariant"] is None
    engine.warm_up({1})
    assert isinstance(engine.batch_invariant, bool)
    if cpu_runs_kernel():
        assert engine.batch_invariant and engine.describe()["batch_invariant"] is True
    leaky = copy.copy(base.decoder)
    forward = base.decoder.forward

    def by_width(tokens: torch.Tensor, *args: Any) -> torch.Tensor:
        return forward(tokens, *args) + 1e-6 * tokens.shape[1]  # as a kernel that sums by blocks of queries

    leaky.forward = by_width  # type: ignore[method-assign]
    tone = torch.zeros(1, base.n_mels, 3000)
    assert not decoder_is_batch_invariant(
        leaky, base.decoder.cross_kv(base.encode(tone)), base.tokenizer.prompt("en", "transcribe")
    )
