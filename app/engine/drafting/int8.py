"""int8 twins of linear layers for the CPU drafts.

Two implementations of the same idea (int8 weights, activations quantized on the fly):
- `Int8Linear` (`app.model.int8`): this project's kernel for x86-64 CPUs with AVX2 + FMA, which runs
  AVX-512 VNNI code where the CPU has it. A draft step runs ~37 small products one row at a time; torch's
  dynamic int8 linear spends 15-30 us on each whatever its size, this kernel 3-10 us
  (docs/history/performance-log.md).
- `Int8DraftStack`: the same kernel running all layers of such a draft in one call, for draft
  steps (every row feeds one token): ~150 small torch ops per step become one.
- `dynamic_int8`: torch's dynamic int8 linear (fbgemm), wherever the kernel cannot be built or run.

The main model, which decides every token, keeps its own weights, so the choice changes the speed of
speculative decoding, never its output. An int8 main model's draft shares its int8 products (they are already
the kernel's) and runs them as one call a step.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from dataclasses import astuple, dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor, nn

from app.model.decoder import CrossKV, DecoderLayer, KVCache, TextDecoder
from app.model.int8 import FloatLinear, Int8Linear, runs_on_kernel
from app.model.native import kernel_extension

log = logging.getLogger(__name__)


def dynamic_int8(linear: FloatLinear) -> nn.Module:
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


def int8_twin(linear: nn.Module, kernel: bool = True) -> nn.Module:
    """An int8 twin of `linear` (which is left as it is): this project's kernel where it runs, else torch's. An
    `Int8Linear` (an int8 main model's) is its own twin: the draft shares its weights."""
    if isinstance(linear, Int8Linear):
        return linear
    assert isinstance(linear, FloatLinear)
    ext = kernel_extension() if kernel and runs_on_kernel(linear) else None
    return Int8Linear(linear, ext) if ext is not None else dynamic_int8(linear)


@dataclass(frozen=True)
class _Product:
    """An `Int8Linear`'s tensors as the kernel reads them."""

    packed: Tensor
    scale: Tensor
    row_sum: Tensor
    bias: Tensor  # empty when the linear has none

    @classmethod
    def of(cls, linear: Int8Linear) -> _Product | None:
        """None where the linear holds no kernel blocks (a many-rows product's weights are oneDNN's)."""
        if linear.packed is None:
            return None
        bias = torch.empty(0) if linear.bias is None else linear.bias
        return cls(linear.packed, linear.scale, linear.row_sum, bias)


@dataclass(frozen=True)
class _Norm:
    weight: Tensor
    bias: Tensor

    @classmethod
    def of(cls, norm: nn.LayerNorm) -> _Norm:
        return cls(norm.weight.detach().float(), norm.bias.detach().float())


@dataclass(frozen=True)
class DraftLayerWeights:
    """One decoder layer of an int8 draft, by name, in the order the kernel's one-call step reads them
    (`DraftStack` in `csrc/int8_linear.cpp`: per layer the self-attention's norm and products, then the
    cross-attention's, then the feed-forward's; each norm as weight, bias; each product as packed
    weights, scales, row sums, bias)."""

    self_norm: _Norm
    qkv: _Product
    self_out: _Product
    cross_norm: _Norm
    cross_q: _Product
    cross_out: _Product
    ffn_norm: _Norm
    fc1: _Product
    fc2: _Product

    @classmethod
    def of(cls, layer: DecoderLayer) -> DraftLayerWeights | None:
        """The layer's weights, or None unless every product the step runs is on the kernel."""
        parts: dict[str, _Norm | _Product] = {}
        for f in fields(cls):
            module = getattr(layer, f.name)
            if isinstance(module, nn.LayerNorm):
                parts[f.name] = _Norm.of(module)
            elif isinstance(module, Int8Linear) and (product := _Product.of(module)) is not None:
                parts[f.name] = product
            else:
                return None
        return cls(**parts)  # type: ignore[arg-type]

    def kernel_args(self) -> list[Tensor]:
        """The tensors in the kernel's order (the fields' order)."""
        return [t for f in fields(self) for t in astuple(getattr(self, f.name))]


class Int8DraftStack:
    """The layers of an int8 draft decoder whose products all run on this project's kernel, as one call.

    For rows feeding one token each: x [B, D] (token + position embeddings) -> the last layer's
    output [B, D], with those positions' keys/values written into `cache` as the module path
    writes them.
    """

    def __init__(self, layers: list[DraftLayerWeights], n_heads: int, eps: float, ext: Any) -> None:
        self._stack = ext.DraftStack([layer.kernel_args() for layer in layers], n_heads, eps)
        self._bf16_of: weakref.ref[CrossKV] | None = None
        self._bf16_copy: tuple[list[Tensor], list[Tensor]] = ([], [])

    @classmethod
    def build(cls, decoder: TextDecoder) -> Int8DraftStack | None:
        """The stack of `decoder`, or None unless every product of every layer runs on the kernel."""
        ext = kernel_extension()
        if ext is None:
            return None
        layers = cast(list[DecoderLayer], list(decoder.layers))
        weights = [DraftLayerWeights.of(layer) for layer in layers]
        if any(w is None for w in weights):
            return None
        first = layers[0]
        return cls(cast(list[DraftLayerWeights], weights), first.n_heads, float(first.self_norm.eps), ext)

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


def int8_draft_decoder(decoder: TextDecoder, kernel: bool = True) -> TextDecoder:
    """An int8 copy of `decoder` for drafting that computes in fp32; shares the embeddings with it (and, when it
    is fp32, its norms and position table).

    kernel: use this project's int8 kernel where the CPU runs it, else torch's.

    Quantized one Linear at a time, straight from the weights (upcast where half): copying the whole decoder
    (and letting `quantize_dynamic` copy it again) held ~300 MB of transient fp32 copies for an
    int8 result of ~50 MB (Whisper base).
    """
    draft = copy.copy(decoder)
    draft._modules = dict(decoder._modules)
    draft._parameters = dict(decoder._parameters)
    layers = []
    for layer in cast(list[DecoderLayer], list(decoder.layers)):
        twin = copy.copy(layer)
        twin._modules = {name: _draft_twin(child, kernel) for name, child in layer._modules.items()}
        layers.append(twin)
    draft.layers = nn.ModuleList(layers)
    draft.proj = int8_twin(decoder.proj, kernel)
    # int8 products take and give fp32: a half-precision decoder's copy gets fp32 copies of its position
    # table and norms (a few hundred KB for Whisper base) and casts the embeddings it looks up.
    draft.norm = _fp32_norm(decoder.norm)
    draft.positions = nn.Parameter(decoder.positions.detach().float(), requires_grad=False)
    draft.token_step = Int8DraftStack.build(draft)
    return draft.eval()


def _draft_twin(module: nn.Module | None, kernel: bool) -> nn.Module | None:
    """A drafting copy's version of one of a layer's modules: int8 for products, fp32 for norms."""
    if isinstance(module, FloatLinear | Int8Linear):
        return int8_twin(module, kernel)
    if isinstance(module, nn.LayerNorm):
        return _fp32_norm(module)
    return module


def _fp32_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    """`norm` itself when fp32, else an fp32 copy (a drafting copy computes in fp32)."""
    return norm if norm.weight.dtype == torch.float32 else copy.deepcopy(norm).float()
