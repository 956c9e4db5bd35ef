"""The lean decoder against transformers' reference implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine.decoding.batch import DecoderState
from app.model.kernels import DecoderAttention
from app.model.native import cpu_runs_kernel
from app.model.whisper import WhisperModel


@pytest.mark.parametrize("attention", ["invariant", "sdpa"])
def test_ragged_incremental_decoding_matches_transformers(
    attention: DecoderAttention, base: WhisperModel, base_dir: Path
) -> None:
    """Both attentions of the decoder (this project's kernel, torch's SDPA with a mask built from each token's
    position) compute Whisper's decoder, rows at different positions feeding uneven chunks."""

    before, base.decoder.attention = base.decoder.attention, attention
    try:
        _ragged_against_transformers(base, base_dir)
    finally:
        base.decoder.attention = before
    if attention == "invariant" and cpu_runs_kernel():
        assert base.decoder.attention_in_use() == "invariant"


def _ragged_against_transformers(base: WhisperModel, base_dir: Path) -> None:
    from transformers import WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    features = torch.randn(2, 80, 3000) * 0.3
    tokens = torch.randint(0, 50000, (2, 12))
    tokens[:, 0] = base.tokenizer.sot
    with torch.inference_mode():
        reference = hf(input_features=features, decoder_input_ids=tokens).logits
        encoder_out = base.encode(features)
        state = DecoderState.start(base.decoder, base.decoder.cross_kv(encoder_out), 2)
        # Feed the rows in different, uneven chunks so that they sit at different positions.
        chunks = ([3, 1, 4, 2, 2], [1, 5, 1, 1, 4])
        outputs: list[list[torch.Tensor]] = [[], []]
        offsets = [0, 0]
        for step in range(5):
            rows = []
            for b in range(2):
                n = chunks[b][step]
                rows.append(tokens[b, offsets[b] : offsets[b] + n].tolist())
            hidden, feed = state.feed(rows)
            for b in range(2):
                n = feed.lengths[b]
                outputs[b].append(base.decoder.logits(hidden[b, :n]))
                offsets[b] += n
    for b in range(2):
        mine = torch.cat(outputs[b])
        torch.testing.assert_close(mine, reference[b], rtol=1e-4, atol=1e-3)


def test_rewind_overwrites_rejected_positions(base: WhisperModel) -> None:
    """After rewinding, new tokens at the rejected positions give the same logits as a clean run."""
    torch.manual_seed(1)
    features = torch.randn(1, 80, 3000) * 0.3
    with torch.inference_mode():
        cross = base.decoder.cross_kv(base.encode(features))
        sot = base.tokenizer.sot
        clean = DecoderState.start(base.decoder, cross, 1)
        expected, _ = clean.feed([[sot, 100, 200, 300]])
        dirty = DecoderState.start(base.decoder, cross, 1)
        dirty_before, _ = dirty.feed([[sot, 100, 999, 998, 997]])
        dirty.rewind([2])
        hidden, _ = dirty.feed([[200, 300]])
    # Equal up to float noise from different matmul shapes (hidden states reach ~1e2).
    torch.testing.assert_close(hidden[0], expected[0, 2:], rtol=1e-4, atol=2e-3)
    assert not torch.allclose(hidden[0], dirty_before[0, 2:4], atol=1e-1)
