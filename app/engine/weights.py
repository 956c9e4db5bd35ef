"""Loading transformers' Whisper weights into the lean modules' fused projections."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def load_fused(target: nn.Linear, parts: Sequence[nn.Linear], scales: Sequence[float] | None = None) -> None:
    """Fill `target` with `parts` stacked along the output dimension, part i times scales[i].

    A part without a bias (Whisper's key projections) contributes zeros to the fused bias.
    """
    scales = scales or [1.0] * len(parts)
    with torch.no_grad():
        target.weight.copy_(torch.cat([p.weight * s for p, s in zip(parts, scales, strict=True)]))
        target.bias.copy_(
            torch.cat(
                [
                    torch.zeros(p.out_features, dtype=p.weight.dtype, device=p.weight.device)
                    if p.bias is None
                    else p.bias * s
                    for p, s in zip(parts, scales, strict=True)
                ]
            )
        )
