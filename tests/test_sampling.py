"""Speculative sampling draws from exactly the main model's distribution (chi-square test)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from app.engine.decoding.batch import Row
from app.engine.decoding.logits import LogitRules, SuppressTokens
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
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    drafted = accepted = 0
    for _ in range(ROUNDS):
        out = encoder_out.expand(ROWS, -1, -1)
        cross = main.decoder.cross_kv(out)
        rows = [Row([50258], 1, rules, max_len=3, eot=-1, temperature=1.0) for _ in range(ROWS)]
        session = None
        if draft is not None:
            drafter = DecoderDrafter("noisy", draft, "main-encoder", length=DraftLength(initial=2, adaptive=False))
            session = drafter.start(DraftInputs(torch.zeros(ROWS, 80, 1), out, cross))
        for d in decode(main, cross, rows, session, generator):
            pairs.append(d.tokens)
            drafted += d.stats.drafted
            accepted += d.stats.accepted
    return np.array(pairs), accepted / max(drafted, 1)


@pytest.mark.slow  # thousands of sampled decoding steps (~150 s on 2 cores)
def test_speculative_sampling_matches_main_distribution(base: WhisperModel) -> None:
    main, draft = _tiny_pair(base)
    plain, _ = _draws(main, None, seed=10)
    spec, acceptance = _draws(main, draft, seed=11)
    # The draft disagrees with the main model often: rejections and residual sampling are exercised.
    assert 0.1 < acceptance < 0.9
    assert plain.shape == spec.shape == (ROWS * ROUNDS, 2)
    for position in range(2):
        table = np.array(
            [np.bincount(plain[:, position], minlength=ALLOWED), np.bincount(spec[:, position], minlength=ALLOWED)]
        )
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 4  # the distribution is not degenerate
        p_value = chi2_contingency(table).pvalue
        assert p_value > 0.001, f"position {position}: distributions differ (p={p_value:.2e})\n{table}"
    joint_plain = np.bincount(plain[:, 0] * ALLOWED + plain[:, 1], minlength=ALLOWED**2)
    joint_spec = np.bincount(spec[:, 0] * ALLOWED + spec[:, 1], minlength=ALLOWED**2)
    table = np.array([joint_plain, joint_spec])
    table = table[:, table.sum(0) >= 10]
    assert chi2_contingency(table).pvalue > 0.001
