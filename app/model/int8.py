"""int8 linear layers on this project's kernel (`csrc/int8_linear.cpp`, built and loaded by `app.model.native`).

Weights are int8 per output row (symmetric, one scale a row); each input row is quantized to uint8 over its
own range when the product runs, multiplied in integers (AVX-512 VNNI or AVX2) and rescaled to fp32. A row's
output depends on that row alone, in integer arithmetic that has no summation order: the product gives a row
the same bits whatever else its call holds, so an int8 decoder is batch-invariant by construction and a
window's encoder states do not depend on the windows beside it.

Used by the CPU drafts (`app.engine.drafting.int8`) and by an int8 main model (`load_model(int8=True)`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from app.model.kernels import LinearInLayout

# The fp32 products an `Int8Linear` can be made from (each has `weight` [out, in], `bias`, the two sizes).
FloatLinear = nn.Linear | LinearInLayout


class Int8Linear(nn.Module):
    """int8 twin of a linear, run by this project's kernel (`ext`, from `kernel_extension()`).

    Input [..., in] fp32 -> output [..., out] fp32.

    many_rows: for products of hundreds of rows (an encoder's frames): the integer products go to oneDNN's
    int8 matmul (`torch._int_mm`: AMX or VNNI, whichever the CPU has) and the kernel quantizes and rescales
    around them. Integer sums are exact in any order, so a row gets the very bits the kernel's own products
    give it; only the weights' layout differs ([out, in] instead of the kernel's blocks).
    """

    packed: Tensor | None
    weight_int8: Tensor | None
    scale: Tensor
    row_sum: Tensor
    bias: Tensor | None

    def __init__(self, linear: FloatLinear, ext: Any, many_rows: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._ext = ext
        packed, scale, row_sum = ext.quantize(linear.weight.detach().float())
        many_rows = many_rows and int_mm_runs()
        self.register_buffer("packed", None if many_rows else packed, persistent=False)
        plain = unpacked(packed, self.out_features) if many_rows else None
        self.register_buffer("weight_int8", plain, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("row_sum", row_sum, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_int8 is None:
            return self._ext.linear(x.float(), self.packed, self.scale, self.row_sum, self.bias)  # type: ignore[no-any-return]
        values, x_scale, x_zero = self._ext.quantize_activations(x.float())
        products = torch._int_mm(values, self.weight_int8.t())
        y = self._ext.rescale(products, x_scale, x_zero, self.scale, self.row_sum, self.bias)
        return y.view(*x.shape[:-1], self.out_features)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        path = "oneDNN int8 matmul" if self.weight_int8 is not None else f"{self._ext.isa()} kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({path})"


def unpacked(packed: Tensor, rows: int) -> Tensor:
    """The kernel's weight blocks [ceil(N/16), K/4, 16, 4] as the plain int8 matrix [N, K] they hold."""
    blocks, depth, width, inputs = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(blocks * width, depth * inputs)[:rows].contiguous()


@functools.cache
def int_mm_runs() -> bool:
    """Whether this torch computes int8 matmuls on the CPU (`torch._int_mm`), exactly."""
    try:
        a = torch.arange(-64, 64, dtype=torch.int8).view(4, 32)
        return bool(torch.equal(torch._int_mm(a, a.t().contiguous()), a.int() @ a.int().t()))
    except (AttributeError, RuntimeError):
        return False


def runs_on_kernel(linear: nn.Module) -> bool:
    """Whether the kernel can take this linear's product (its input size a multiple of 4)."""
    return isinstance(linear, FloatLinear) and linear.in_features % 4 == 0


def quantize_linears(module: nn.Module, ext: Any, many_rows: Callable[[str], bool] = lambda name: False) -> int:
    """Replace, in place, every linear under `module` (plain or packed) by its `Int8Linear`; returns how many.

    many_rows(name): whether the linear of that dotted name runs products of many rows (`Int8Linear`). One
    at a time, so that the fp32 weights of each go as soon as its int8 twin exists. A tied weight (the
    decoder's vocabulary projection reads the embedding table) stays where it is also read otherwise.
    """
    count = 0
    for name, child in list(module.named_modules()):
        if not isinstance(child, FloatLinear):
            continue
        if not runs_on_kernel(child):
            raise ValueError(f"{name}: an input size of {child.in_features} is not a multiple of 4")
        parent_name, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent_name), attribute, Int8Linear(child, ext, many_rows(name)))
        count += 1
    return count


def holds_int8(module: nn.Module | None) -> bool:
    """Whether any product under `module` is an `Int8Linear`."""
    return module is not None and any(isinstance(m, Int8Linear) for m in module.modules())
