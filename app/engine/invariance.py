"""Does the main decoder give a token the same bits however a pass feeds it? Checked on the machine at hand.

Speculative decoding's output is main-only's bit for bit when a token's logits do not depend on how many
tokens its pass feeds or which rows share the pass (docs/engine.md, "Batch-invariant decoding"). That
rests on the kernels the machine runs (this project's attention; oneDNN's products, whose choices depend
on the CPU and the thread count), so the worker checks it once at warm-up and reports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.batch import DecoderState
from app.engine.decoder import CrossKV, TextDecoder

# Tokens fed a pass by each of two rows after the prompt: one row as verification passes feed them, the
# other as a batch of rows at other positions would.
CHUNKS = ((3, 5, 1, 4), (5, 1, 4, 3))


@torch.inference_mode()
def batch_invariant(decoder: TextDecoder, cross: CrossKV, prompt: Sequence[int]) -> bool:
    """True if the logits at every position come out the same bits fed one token a pass (plain steps) as
    fed several at a time by two rows at different positions in one pass (verification, batches).

    cross: one row's audio-frame keys/values ([1, H, T, Dh] per layer). The tokens are the decoder's own
    greedy choices on its raw logits, 13 of them after the prompt.
    """
    state = DecoderState.start(decoder, cross, 1)
    hidden, _ = state.feed([list(prompt)])
    alone = [decoder.logits(hidden[0, -1])]
    tokens: list[int] = []
    for _ in range(sum(CHUNKS[0])):
        tokens.append(int(alone[-1].argmax()))
        hidden, _ = state.feed([[tokens[-1]]])
        alone.append(decoder.logits(hidden[0, -1]))
    pair = CrossKV([torch.cat([k, k]) for k in cross.keys], [torch.cat([v, v]) for v in cross.values])
    state = DecoderState.start(decoder, pair, len(CHUNKS))
    hidden, _ = state.feed([list(prompt)] * len(CHUNKS))
    got: list[list[torch.Tensor]] = [[row] for row in decoder.logits(hidden[:, -1])]
    done = [0] * len(CHUNKS)
    for sizes in zip(*CHUNKS, strict=True):
        hidden, feed = state.feed([tokens[d : d + n] for d, n in zip(done, sizes, strict=True)])
        logits = decoder.logits(hidden)  # every row and position in one product, as a pass computes them
        for r, n in enumerate(feed.lengths):
            got[r] += list(logits[r, :n])
            done[r] += n
    return all(
        len(row) == len(alone) and all(torch.equal(a, b) for a, b in zip(alone, row, strict=True)) for row in got
    )
