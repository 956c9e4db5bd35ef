"""fp32 products over fp16 weights, on this project's kernel library (`csrc/half_linear.inc`).

The converted checkpoints store Whisper's weights in fp16, so an fp32 model's weights are exact upcasts. The
decoder's products run a few rows at a time (a step, a verification of a few drafted tokens), where reading
the weights is what costs: `HalfLinear` keeps a weight in fp16, as blocks of 16 outputs side by side for each
input ([ceil(N/16), K, 16]), and the kernel widens each weight exactly and sums every output as one chain of FMAs
over the inputs in order, then adds the bias. A row's outputs are then the same bits whatever else the call holds
and on either instruction set, which keeps a decoder batch-invariant by construction, and the weights take half
the memory and half the reading of oneDNN's packed fp32 copies. For Whisper base on 2 threads of an Intel Xeon,
one row: 12-24 us a product against oneDNN's 36-109 us; 28 rows: 61-211 against 66-237 us.

Shapes: N outputs, K inputs, B = ceil(N / 16) blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from app.model.kernels import LinearInLayout
from app.model.native import kernel_extension

BLOCK = 16  # outputs side by side in a block of the kernel's weights


def half_blocks(weight: Tensor, rows: int = 4096) -> Tensor | None:
    """weight [N, K] as the kernel's fp16 blocks [B, K, 16] (the last block padded with zeros), or None where some
    entry is not a half-precision number. Filled `rows` outputs at a time: no second full-size copy is made."""
    outputs, inputs = weight.shape
    blocks = torch.zeros(-(-outputs // BLOCK), inputs, BLOCK, dtype=torch.float16)
    rows -= rows % BLOCK
    with torch.no_grad():
        for start in range(0, outputs, rows):
            part = weight[start : start + rows]
            half = part.half()
            if not torch.equal(half.float(), part.float()):
                return None
            padded = torch.zeros(-(-half.shape[0] // BLOCK) * BLOCK, inputs, dtype=torch.float16)
            padded[: half.shape[0]] = half
            first = start // BLOCK
            blocks[first : first + padded.shape[0] // BLOCK] = padded.view(-1, BLOCK, inputs).transpose(1, 2)
    return blocks


def unblocked(blocks: Tensor, outputs: int) -> Tensor:
    """The fp16 blocks [B, K, 16] as the plain weight [N, K] they hold (a copy)."""
    return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[:outputs]


class HalfLinear(LinearInLayout):
    """A linear layer whose weight is held in fp16 blocks (`half_blocks`): x [..., K] fp32 -> [..., N] fp32.

    `blocks` may be shared with another module (the decoder's token table, `app.model.tokentable`)."""

    blocks: Tensor
    bias: Tensor | None

    def __init__(self, blocks: Tensor, out_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        self.in_features = blocks.shape[1]
        self.out_features = out_features
        self.register_buffer("blocks", blocks, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> HalfLinear | None:
        """`linear`'s fp16 twin, or None where its weight is not exact in fp16 or the kernel does not run here."""
        if kernel_extension() is None or linear.weight.device.type != "cpu":
            return None
        blocks = half_blocks(linear.weight.detach())
        return None if blocks is None else cls(blocks, linear.out_features, linear.bias)

    @property
    def weight(self) -> Tensor:
        """The weight [N, K] in fp32 (a copy: for quantizing a draft's twin of it)."""
        return unblocked(self.blocks, self.out_features).float()

    def forward(self, x: Tensor) -> Tensor:
        ext = kernel_extension()
        assert ext is not None, "a HalfLinear is made only where the kernel library runs"
        return ext.half_linear(x.float(), self.blocks, self.out_features, self.bias)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weights (kernel)"


def halve_linears(module: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> int:
    """Replace, in place, every fp32 CPU `nn.Linear` under `module` whose weight fp16 holds exactly by its
    `HalfLinear`, except those whose dotted name `skip` names; returns how many. One at a time, so that each fp32
    weight goes as soon as its twin exists. A weight tied to another module's stays (the tied projection has its
    own way to share, `app.model.tokentable.share_table`)."""
    count = 0
    others = (m for m in module.modules() if not isinstance(m, nn.Linear))
    shared = {id(p) for m in others for p in m.parameters(recurse=False)}
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear or skip(name) or child.weight.dtype != torch.float32:
            continue
        if id(child.weight) in shared:
            continue
        twin = HalfLinear.of(child)
        if twin is None:
            continue
        parent, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent), attribute, twin)
        count += 1
    return count


def holds_half(module: nn.Module | None) -> bool:
    """Whether any product under `module` is a `HalfLinear`."""
    return module is not None and any(isinstance(m, HalfLinear) for m in module.modules())
