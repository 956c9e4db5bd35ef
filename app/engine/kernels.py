"""CPU kernels for the fp32 linear layers: oneDNN with each weight reordered once.

On these machines torch's default fp32 GEMM (MKL) does not use the CPU's AVX-512 units,
while oneDNN does: the encoder's projections run about twice as fast, and the small-M
products of decoding (1 token, or a few verified drafts) too. The arithmetic is the same
fp32 product y = x W^T + b; only the summation order inside the kernel differs, and both
decoding modes run the very same kernels, so their outputs stay identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def packing_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An fp32 `nn.Linear` whose weight [out, in] is held in oneDNN's blocked layout.

    Input [..., in] -> output [..., out]. `weight` gives the plain [out, in] weight back, the
    state dict holds it as `nn.Linear` would, and a deep copy is a plain `nn.Linear` (the
    packed layout is a runtime detail, and quantization works on plain linears).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        return self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Linear:
        return self.to_linear()

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(module: nn.Module) -> int:
    """Replace, in place, every fp32 CPU `nn.Linear` under `module` by a `PackedLinear`; returns how many.

    Tied weights stay tied where they are read otherwise (an embedding keeps its plain table;
    the packed projection holds its own copy of it)."""
    if not packing_available():
        return 0
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
