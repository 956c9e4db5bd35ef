"""Does the main decoder give a token the same bits however a pass feeds it? Checked on the machine at hand.

Speculative decoding's output is main-only's bit for bit when a token's logits do not depend on how many
tokens its pass feeds or which rows share the pass (docs/engine.md, "Batch-invariant decoding"). That
rests on the kernels the machine runs (this project's attention; oneDNN's products, whose choices depend
on the CPU, the thread count and the number of rows), so the worker checks it once at warm-up and
reports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from app.engine.decoding.batch import DecoderState
from app.model.decoder import CrossKV, TextDecoder
from app.model.whisper import WhisperModel

log = logging.getLogger(__name__)

# Tokens fed by each row in each pass after the prompt (0: the row sits the pass out). Together they
# make the widths of real passes: one token (plain steps), a few, and 13 (a long verification), in
# products of up to four rows of 13 positions.
CHUNKS = ((1, 13, 0, 0), (13, 1, 0, 0), (3, 5, 2, 4), (5, 1, 4, 4))
TOKENS = 14  # each row's total


@torch.inference_mode()
def decoder_is_batch_invariant(decoder: TextDecoder, cross: CrossKV, prompt: Sequence[int], rows: int = 4) -> bool:
    """True if the logits at every position come out the same bits fed one token a pass (plain steps) as
    fed several at a time by `rows` (1 to 4) rows at different positions in one pass (verification passes,
    batches).

    cross: one row's audio-frame keys/values ([1, H, T, Dh] per layer). The tokens are the decoder's own
    greedy choices on its raw logits.
    """
    rows = max(1, min(rows, len(CHUNKS)))
    capacity = len(prompt) + TOKENS
    state = DecoderState.start(decoder, cross, 1, capacity)
    hidden, _ = state.feed([list(prompt)])
    alone = [decoder.logits(hidden[0, -1])]
    tokens: list[int] = []
    for _ in range(TOKENS):
        tokens.append(int(alone[-1].argmax()))
        hidden, _ = state.feed([[tokens[-1]]])
        alone.append(decoder.logits(hidden[0, -1]))
    wide = CrossKV(
        [k.expand(rows, -1, -1, -1).contiguous() for k in cross.keys],
        [v.expand(rows, -1, -1, -1).contiguous() for v in cross.values],
    )
    state = DecoderState.start(decoder, wide, rows, capacity)
    hidden, _ = state.feed([list(prompt)] * rows)
    got: list[list[torch.Tensor]] = [[row] for row in decoder.logits(hidden[:, -1])]
    done = [0] * rows
    for sizes in zip(*CHUNKS[:rows], strict=True):
        hidden, feed = state.feed([tokens[d : d + n] for d, n in zip(done, sizes, strict=True)])
        logits = decoder.logits(hidden)  # every row and position in one product, as a pass computes them
        for r, n in enumerate(feed.lengths):
            got[r] += list(logits[r, :n])
            done[r] += n
    return all(
        len(row) == len(alone) and all(torch.equal(a, b) for a, b in zip(alone, row, strict=True)) for row in got
    )


def checked_batch_invariance(main: WhisperModel, states: Callable[[], torch.Tensor], rows: int) -> bool | None:
    """`decoder_is_batch_invariant` for the main model, reading one window's encoder states (`states()`: [1, 1500,
    D]), with the answer logged; None (logged too) where the check fails to run: it is a diagnosis, not a reason to
    stop serving."""
    try:
        with torch.inference_mode():
            cross = main.decoder.cross_kv(states())
            invariant = decoder_is_batch_invariant(main.decoder, cross, main.tokenizer.prompt("en", "transcribe"), rows)
    except Exception:
        log.exception("could not check whether the main decoder is batch-invariant")
        return None
    attention = main.decoder.attention_in_use()
    if invariant:
        log.info("the main decoder is batch-invariant here: speculative output is main-only's bit for bit")
    else:
        # Expected with torch's attention (GPU, half precision, the sdpa setting); a surprise with ours.
        log.log(
            logging.WARNING if attention == "invariant" else logging.INFO,
            "the main decoder is not batch-invariant here (%s attention, %s): speculative output is"
            " main-only's token for token wherever no two logits are within rounding of each other",
            attention, str(main.dtype).removeprefix("torch."),
        )  # fmt: skip
    return invariant
