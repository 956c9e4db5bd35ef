"""Sampling (temperature > 0) draws from the main model's distribution (chi-square test), and speculative
sampling gives main-only's tokens exactly, with a draft that often disagrees."""

from __future__ import annotations

import copy

import numpy as np
import torch
from scipy.stats import chi2_contingency

from app.engine.decoding.batch import Row
from app.engine.decoding.logits import LogitRules, SuppressTokens
from app.engine.decoding.search import Greedy
from app.engine.drafting.base import DraftInputs, DraftLength
from app.engine.drafting.decoder import DecoderDrafter
from app.engine.generate import decode
from app.model.decoder import TextDecoder
from app.model.whisper import GenerationConstants, WhisperModel

VOCAB = 51865
ALLOWED = 12  # tokens 0..11 may be sampled, so that counts fill a small table
ROWS = 100
ROUNDS = 30  # 3000 draws per mode


def _tiny_pair(base: WhisperModel) -> tuple[WhisperModel, TextDecoder]:
    torch.manual_seed(0)
    decoder = TextDecoder(VOCAB, d_model=64, n_heads=2, ffn_dim=128, n_layers=2, n_positions=448).eval()
    with torch.no_grad():
        decoder.embed.weight[:ALLOWED] *= 0.15  # several likely tokens, none dominant
    draft = copy.deepcopy(decoder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 1.5)
    main = WhisperModel(
        "tiny-random",
        None,
        decoder,
        base.tokenizer,
        GenerationConstants((), ()),
        80,
        torch.device("cpu"),
        torch.float32,
    )
    return main, draft


def _draws(main: WhisperModel, draft: TextDecoder | None, seed: int) -> tuple[np.ndarray, float]:
    rules = LogitRules((SuppressTokens(tuple(range(ALLOWED, VOCAB))),))
    torch.manual_seed(2)
    encoder_out = torch.randn(1, 30, 64)
    pairs = []
    drafted = accepted = 0
    for r in range(ROUNDS):
        out = encoder_out.expand(ROWS, -1, -1)
        cross = main.decoder.cross_kv(out)
        rows = [
            Row([50258], 1, rules, max_len=3, eot=-1, temperature=1.0, seed=seed * 100_000 + r * ROWS + i)
            for i in range(ROWS)
        ]
        session = None
        if draft is not None:
            drafter = DecoderDrafter("noisy", draft, "main-encoder", length=DraftLength(initial=2, adaptive=False))
            session = drafter.start(DraftInputs(torch.zeros(ROWS, 80, 1), out, cross))
        for d in decode(main, cross, list(range(ROWS)), [Greedy(row) for row in rows], session):
            pairs.append(d.tokens)
            drafted += d.stats.drafted
            accepted += d.stats.accepted
    return np.array(pairs), accepted / max(drafted, 1)


def test_sampling_draws_from_the_main_distribution_and_speculation_changes_nothing(base: WhisperModel) -> None:
    main, draft = _tiny_pair(base)
    plain, _ = _draws(main, None, seed=10)
    spec, acceptance = _draws(main, draft, seed=10)
    # The draft disagrees with the main model often: rejections are exercised, and change no token.
    assert 0.1 < acceptance < 0.9
    assert np.array_equal(plain, spec)
    # Draws with other seeds follow the same distribution as these (a draw is the main model's sample).
    other, _ = _draws(main, None, seed=11)
    assert plain.shape == other.shape == (ROWS * ROUNDS, 2) and not np.array_equal(plain, other)
    for position in range(2):
        table = np.array(
            [np.bincount(plain[:, position], minlength=ALLOWED), np.bincount(other[:, position], minlength=ALLOWED)]
        )
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 4  # the distribution is not degenerate
        p_value = chi2_contingency(table).pvalue
        assert p_value > 0.001, f"position {position}: distributions differ (p={p_value:.2e})\n{table}"


def test_sampled_tokens_follow_softmax() -> None:
    """argmax(logits / T + Gumbel noise) over many seeds is distributed as softmax(logits / T)."""
    from scipy.stats import chisquare

    from app.engine.decoding.selection import perturbed

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -float("inf")]])
    for temperature in (0.5, 1.0):
        draws = [int(perturbed(logits, temperature, seed, 7).argmax()) for seed in range(4000)]
        counts = np.bincount(draws, minlength=5)
        assert counts[4] == 0  # a suppressed token is never drawn
        probs = torch.softmax(logits[0, :4].double() / temperature, -1).numpy()
        expected = probs / probs.sum() * len(draws)
        assert chisquare(counts[:4], expected).pvalue > 0.001
