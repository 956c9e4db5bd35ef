"""Choosing tokens from verified logits: greedy matching, or speculative sampling.

Both take the main model's (rule-filtered) logits at the n+1 positions of a row's
n drafts and return how many drafts to keep plus the next token. With no drafts
they are plain greedy decoding and plain temperature sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def speculative_sample(
    logits: Tensor,
    drafts: list[int],
    draft_probs: Tensor | None,
    temperature: float,
    generator: torch.Generator,
) -> Selection:
    """Leviathan et al.: keep draft j with probability min(1, p_j(d_j) / q_j(d_j)); on the first
    rejection sample from normalize(max(0, p_j - q_j)); after n acceptances sample from p_n.
    The result is distributed exactly as sampling from the main model (logits [n+1, V],
    draft_probs [n, V] the draft's sampling distributions)."""
    p = torch.softmax(logits / temperature, dim=-1)
    for j, token in enumerate(drafts):
        assert draft_probs is not None
        q = draft_probs[j]
        ratio = float(p[j, token]) / max(float(q[token]), 1e-30)
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            continue
        residual = (p[j] - q).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        return Selection(j, int(torch.multinomial(dist, 1, generator=generator)))
    return Selection(len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator)))


def sample(logits: Tensor, temperature: float, generator: torch.Generator) -> tuple[int, Tensor]:
    """Sample one token from logits [V] at `temperature`; also return the distribution [V]."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
