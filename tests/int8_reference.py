"""What the int8 products compute, in exact integer arithmetic: the reference both int8 test files hold the
kernel library's and oneDNN's paths to."""

from __future__ import annotations

import torch
from torch import Tensor

from app.model.int8 import Int8Linear, unpacked


def integer_reference(twin: Int8Linear, x: Tensor) -> Tensor:
    """The product from the twin's int8 weights: x quantized to uint8 row by row over its range, dot products
    in int64, then both scales and the bias (in float64)."""
    weight = twin.weight_int8
    if weight is None:
        assert twin.packed is not None
        weight = unpacked(twin.packed, twin.out_features)
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    inv = 1 / scale
    zero = (-lo * inv).round().clamp(0, 255)
    xq = ((x * inv).round() + zero).clamp(0, 255).long()
    dot = (xq @ weight.long().T).double() - zero.double() * twin.row_sum.double()
    out = dot * scale.double() * twin.scale.double()
    return (out + twin.bias.double() if twin.bias is not None else out).float()
