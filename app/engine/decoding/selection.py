"""Choosing tokens from verified logits: greedy matching, also for sampling.

`greedy_select` takes the main model's (rule-filtered) logits at the n+1 positions of a row's n drafts and
returns how many drafts to keep plus the next token; with no drafts it is plain greedy decoding.

Sampling at a temperature is greedy decoding of perturbed logits (the Gumbel-max trick): the token at
position t is argmax(logits / T + g_t), with g_t Gumbel(0, 1) noise drawn from a generator keyed by the
row's seed and t alone, which makes it a draw from softmax(logits / T). Because the noise does not depend on
how a pass reaches position t (alone or after drafts, in whatever batch), speculative sampling verifies
drafts exactly as greedy decoding does and gives main-only's tokens bit for bit, and the same request always
gets the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SEED_BITS = (1 << 63) - 1


@dataclass(frozen=True)
class Selection:
    accepted: int
    next_token: int


def greedy_select(logits: Tensor, drafts: list[int]) -> Selection:
    """logits [n+1, V]: keep drafts while they equal the main model's argmax."""
    predicted = logits.argmax(-1).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == predicted[m]:
        m += 1
    return Selection(m, predicted[m])


def gumbel(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """Gumbel(0, 1) noise [vocab] for token `position` of the row keyed by `seed`: always the same numbers."""
    generator = torch.Generator(device=device).manual_seed(hash((seed, position)) & SEED_BITS)
    uniform = torch.rand(vocab, generator=generator, device=device)
    return -torch.log(-torch.log(uniform))


def perturbed(logits: Tensor, temperature: float, seed: int, first_position: int) -> Tensor:
    """logits [k, V] of positions first_position.. as `logits / temperature + noise`: their argmax is a sample."""
    k, vocab = logits.shape
    noise = torch.stack([gumbel(seed, first_position + j, vocab, logits.device) for j in range(k)])
    return logits.float() / temperature + noise
