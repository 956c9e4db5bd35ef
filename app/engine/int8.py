"""int8 twins of linear layers for the CPU drafts.

Two implementations of the same idea (int8 weights, activations quantized on the fly):
- `Int8Linear`: this project's kernel (`csrc/int8_linear.cpp`, built and loaded by `app.engine.native`)
  for x86-64 CPUs with AVX2 + FMA, which runs AVX-512 VNNI code where the CPU has it. A draft step
  runs ~37 small products one row at a time; torch's dynamic int8 linear spends 15-30 us on each
  whatever its size, this kernel 3-10 us (docs/performance.md).
- `Int8DraftStack`: the same kernel running all layers of such a draft in one call, for draft
  steps (every row feeds one token): ~150 small torch ops per step become one.
- `dynamic_int8`: torch's dynamic int8 linear (fbgemm), wherever the kernel cannot be built or run.

Only drafts use them: the main model, which decides every token, keeps its own weights, so the
choice changes the speed of speculative decoding, never its output.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from app.engine.kernels import PackedLinear
from app.engine.native import kernel_extension

if TYPE_CHECKING:
    from app.engine.decoder import CrossKV, KVCache, TextDecoder

log = logging.getLogger(__name__)


class Int8Linear(nn.Module):
    """int8 twin of a linear: weights int8 per output row (symmetric), run by this project's kernel.

    Input [..., in] fp32 -> output [..., out] fp32. Each input row is quantized to uint8 over its
    own range, as torch's dynamic int8 linear does for a whole input.
    """

    def __init__(self, linear: nn.Linear | PackedLinear, ext: Any) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._ext = ext
        packed, scale, row_sum = ext.quantize(linear.weight.detach().float())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("row_sum", row_sum, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self._ext.linear(x.float(), self.packed, self.scale, self.row_sum, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self._ext.isa()} kernel)"


def dynamic_int8(linear: nn.Linear | PackedLinear) -> nn.Module:
    """torch's dynamically quantized twin of `linear` (int8 weights, fp32 activations)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import default_dynamic_qconfig

    source = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    source.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)  # no copy when fp32
    if linear.bias is not None:
        source.bias = nn.Parameter(linear.bias.detach().float(), requires_grad=False)
    source.qconfig = default_dynamic_qconfig  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return DynamicInt8Linear.from_float(source)


def int8_twin(linear: nn.Linear | PackedLinear, kernel: bool = True) -> nn.Module:
    """An int8 twin of `linear` (which is left as it is): this project's kernel where it runs, else torch's."""
    ext = kernel_extension() if kernel and linear.in_features % 4 == 0 else None
    return Int8Linear(linear, ext) if ext is not None else dynamic_int8(linear)


class Int8DraftStack:
    """The layers of an int8 draft decoder whose products all run on this project's kernel, as one call.

    For rows feeding one token each: x [B, D] (token + position embeddings) -> the last layer's
    output [B, D], with those positions' keys/values written into `cache` as the module path
    writes them.
    """

    def __init__(self, decoder: TextDecoder, ext: Any) -> None:
        params = []
        layers: list[Any] = list(decoder.layers)
        for layer in layers:
            linears = [layer.qkv, layer.self_out, layer.cross_q, layer.cross_out, layer.fc1, layer.fc2]
            parts: list[list[Tensor]] = [[lin.packed, lin.scale, lin.row_sum, _or_empty(lin.bias)] for lin in linears]
            norms: list[list[Tensor]] = [
                [n.weight.detach().float(), n.bias.detach().float()]
                for n in (layer.self_norm, layer.cross_norm, layer.ffn_norm)
            ]
            params.append(
                norms[0] + parts[0] + parts[1] + norms[1] + parts[2] + parts[3] + norms[2] + parts[4] + parts[5]
            )
        first = layers[0]
        self._stack = ext.DraftStack(params, first.n_heads, float(first.self_norm.eps))
        self._bf16_of: weakref.ref[CrossKV] | None = None
        self._bf16_copy: tuple[list[Tensor], list[Tensor]] = ([], [])

    @classmethod
    def build(cls, decoder: TextDecoder) -> Int8DraftStack | None:
        """The stack of `decoder`, or None unless every product of every layer runs on the kernel."""
        ext = kernel_extension()
        names = ("qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")
        if ext is None or not all(isinstance(getattr(layer, n), Int8Linear) for layer in decoder.layers for n in names):
            return None
        return cls(decoder, ext)

    def __call__(self, x: Tensor, positions: list[int], writes: list[int], cache: KVCache, cross: CrossKV) -> Tensor:
        """x [B, D] -> [B, D]; row b sits at positions[b] and writes its keys/values at slot writes[b]."""
        keys, values = self._bf16(cross) if x.shape[0] == 1 else (cross.keys, cross.values)
        return self._stack.step(x, positions, writes, cache.keys, cache.values, keys, values)  # type: ignore[no-any-return]

    def _bf16(self, cross: CrossKV) -> tuple[list[Tensor], list[Tensor]]:
        """bfloat16 copies of one row's audio-frame keys/values, made once per request (the last kept).

        A draft step reads them all from memory (the weights push them out of the cache between
        steps): half the bytes of fp32 saved ~0.3 ms per step at 600 frames. Batches read the fp32
        views instead, which costs no memory. Drafts only: the main model keeps its fp32 keys/values.
        """
        if self._bf16_of is None or self._bf16_of() is not cross:
            self._bf16_copy = (
                [k.to(torch.bfloat16, memory_format=torch.contiguous_format) for k in cross.keys],
                [v.to(torch.bfloat16, memory_format=torch.contiguous_format) for v in cross.values],
            )
            self._bf16_of = weakref.ref(cross)  # not a reference: the request's tensors go when it ends
        return self._bf16_copy


def _or_empty(t: Tensor | None) -> Tensor:
    return torch.empty(0) if t is None else t
