"""CPU kernels for fp32 models: oneDNN instead of torch's default GEMM and attention.

On the AMD machines torch's default fp32 GEMM (MKL) does not use the CPU's AVX-512 units and
streams the weights of small-M products (decoding: 1 token, or a few verified drafts) at a
fraction of the memory bandwidth, while oneDNN with each weight reordered once
(`PackedLinear`) runs the encoder's projections about twice as fast and the decoder's steps
up to four times as fast. The encoder's 1500x1500 self-attention runs either as plain oneDNN
products per head or through torch's CPU flash-attention kernel, whichever this CPU runs
faster (`attention`: oneDNN on the AMD machines, flash on an Intel one). The arithmetic is the
same fp32 function; only the summation order inside the kernels differs, and both decoding
modes run the very same kernels, so their outputs stay identical. Everywhere else (GPU, half
precision, a torch without oneDNN) the same entry points fall back to torch's own ops.

The decoders' attention (`prefix_attention`) runs on this project's kernel library instead, which
computes each query on its own: with `PackedLinear` taking a lone row as two, a token's logits are
then the same bits whatever else its pass feeds (docs/engine.md, "Batch-invariant decoding").
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.model.native import kernel_extension
from app.model.tuning import remembered

log = logging.getLogger(__name__)

# Query rows per attention block on the CPU: a block's scores (rows x T fp32) stay near the
# cache. 750 rows of 1500 keys (4.5 MB) ran 20% faster than whole heads on 2 cores.
ATTENTION_BLOCK_ROWS = 750


@functools.cache
def packing_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class LinearInLayout(nn.Module):
    """A linear layer that holds its weight [out, in] in a layout of its own: `weight` gives the plain fp32 weight
    back, the state dict holds it as `nn.Linear` would, and a deep copy is a plain `nn.Linear` (the layout is a
    runtime detail, and quantization works on plain linears)."""

    in_features: int
    out_features: int
    bias: Tensor | None

    @property
    def weight(self) -> Tensor:
        raise NotImplementedError

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


class PackedLinear(LinearInLayout):
    """An fp32 `nn.Linear` whose weight [out, in] is held in oneDNN's blocked layout: [..., in] -> [..., out]."""

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
        return _rows_alike(lambda t: torch.ops.mkldnn._linear_pointwise(t, self.packed, self.bias, "none", [], ""), x)

    def gelu(self, x: Tensor) -> Tensor:
        """gelu(x W^T + b) with the activation applied inside the kernel (erf form, as Whisper's)."""
        product = torch.ops.mkldnn._linear_pointwise
        return _rows_alike(lambda t: product(t, self.packed, self.bias, "gelu", [], "none"), x)

    def add(self, x: Tensor, residual: Tensor) -> Tensor:
        """residual + x W^T + b with the sum done inside the kernel (`residual` has the output's shape)."""
        product = torch.ops.mkldnn._linear_pointwise.binary
        return _rows_alike(lambda t, r: product(t, r, self.packed, self.bias, "add"), x, residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def _doubled(x: Tensor) -> Tensor:
    """A one-row tensor [..., 1, K] as two copies of its row, [2, K]."""
    return x.reshape(1, -1).expand(2, -1).contiguous()


def _rows_alike(product: Callable[..., Tensor], x: Tensor, *alongside: Tensor) -> Tensor:
    """product(x, *alongside), where a lone row of x gets the same bits it gets among other rows
    (`alongside`: inputs with a row per row of x, such as a residual, doubled with it).

    oneDNN splits the sum of a one-row product with a long input (Whisper's fc2, 2048 inputs) across
    threads, so a row alone comes out ~1e-7 off what the same row gives in a product of two or more
    rows; fed twice, it takes the path of every other row count (measured from 2 to 1000 rows, every
    product shape of Whisper base, on one and two threads: tests/test_kernels.py). Whether that holds on
    the machine at hand, the worker checks at warm-up (`app.engine.invariance`). The copy costs nothing
    a one-row product does not already pay in reading the weight.
    """
    if x.numel() != x.shape[-1]:
        return product(x, *alongside)
    out = product(_doubled(x), *(_doubled(t) for t in alongside))
    return out[:1].view(*x.shape[:-1], out.shape[-1])


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


def linear_gelu(linear: nn.Module, x: Tensor) -> Tensor:
    """gelu(linear(x)), fused into the product where `linear` is packed."""
    return linear.gelu(x) if isinstance(linear, PackedLinear) else F.gelu(linear(x))


def linear_add(linear: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """residual + linear(x), fused into the product where `linear` is packed."""
    return linear.add(x, residual) if isinstance(linear, PackedLinear) else residual + linear(x)


DecoderAttention = Literal["invariant", "sdpa"]


def prefix_attention(
    q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor | None, kernel: DecoderAttention = "invariant"
) -> Tensor:
    """Attention of each query over its own first keys: q [B, S, H * Dh], keys/values [B, H, T, Dh],
    lengths [B, S] (how many keys each query sees, 1..T; None: all T) -> [B, S, H * Dh].

    "invariant": on a CPU, for fp32 queries over fp32 or bfloat16 keys, this project's kernel
    computes every query on its own, in an order that depends on nothing else in the call. So a
    verification pass that feeds k tokens gives each of them the very bits a one-token step gives it,
    which is what keeps speculative decoding's output main-only's to the bit (torch's SDPA sums in
    blocks of queries: a query alone comes out ~1e-7 off the same query among others). Where the
    kernel does not run, and for "sdpa", torch's `scaled_dot_product_attention`.
    """
    b, s, d = q.shape
    h, t, dh = keys.shape[1], keys.shape[2], keys.shape[3]
    ext = _invariant_kernel(q, keys) if kernel == "invariant" else None
    if ext is not None:
        if lengths is None:
            lengths = torch.full((b, s), t, dtype=torch.long)
        return ext.attention(q, keys, values, lengths)  # type: ignore[no-any-return]
    mask = None if lengths is None else torch.arange(t, device=q.device).view(1, 1, 1, t) < lengths.view(b, 1, s, 1)
    heads = q.view(b, s, h, dh).transpose(1, 2)
    out = F.scaled_dot_product_attention(heads, keys, values, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, s, d)


def _invariant_kernel(q: Tensor, keys: Tensor) -> Any | None:
    """The kernel library where it computes this attention, else None."""
    if keys.dtype not in (torch.float32, torch.bfloat16) or not invariant_attention_runs(
        q.device, q.dtype, q.shape[-1] // keys.shape[1]
    ):
        return None
    return kernel_extension()


def invariant_attention_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefix_attention(..., "invariant")` runs this project's kernel for such queries."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim % 16 == 0
        and head_dim <= 128
        and kernel_extension() is not None
    )


AttentionKernel = Literal["auto", "onednn", "flash"]
ATTENTION_KERNELS: tuple[AttentionKernel, ...] = ("auto", "onednn", "flash")


def attention(q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel = "auto") -> Tensor:
    """Unmasked attention softmax(q k^T) v with q already scaled: q, k, v [B, H, T, Dh] -> [B, T, H * Dh].

    `kernel`: "onednn" (fp32 on a CPU with oneDNN, else flash), "flash" (torch's
    `scaled_dot_product_attention`), or "auto": the one that ran this shape faster here
    (`preferred_attention`). The two differ only in the order of their sums.
    """
    if preferred_attention(q, kernel) == "onednn":
        return _onednn_attention(q, k, v)
    return _flash_attention(q, k, v)


def preferred_attention(q: Tensor, kernel: AttentionKernel = "auto") -> Literal["onednn", "flash"]:
    """The kernel `attention` runs for queries shaped like `q` [B, H, T, Dh] when asked for `kernel`.

    flash wherever oneDNN's does not apply (GPU, half precision, a torch without oneDNN); for
    "auto", the faster one on this machine: timed once per machine, shape and thread count and
    remembered (`app.model.tuning`: a restarted server computes as before), on one row and at most
    two heads (both kernels' cost grows linearly in them); flash must beat oneDNN by 10% to be chosen.
    """
    if not _onednn_attention_applies(q):
        return "flash"
    if kernel != "auto":
        return kernel
    _, h, t, dh = q.shape
    return _timed_choice(min(h, 2), t, dh, torch.get_num_threads())


@functools.cache
def _timed_choice(heads: int, frames: int, head_dim: int, threads: int) -> Literal["onednn", "flash"]:
    what = f"encoder attention, {heads} heads x {frames} frames x {head_dim}, {threads} threads"
    what += f", oneDNN in blocks of {ATTENTION_BLOCK_ROWS} rows"  # the kernels as timed
    return remembered(what, ("onednn", "flash"), lambda: _time_attention(heads, frames, head_dim))


def _time_attention(heads: int, frames: int, head_dim: int) -> Literal["onednn", "flash"]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, frames, head_dim, generator=generator) for _ in range(3))
    candidates: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
        "onednn": _onednn_attention,
        "flash": _flash_attention,
    }
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for rep in range(4):  # the first round warms both up and is not counted
            for name, kernel in candidates.items():
                start = time.perf_counter()
                kernel(q, k, v)
                if rep:
                    seconds[name].append(time.perf_counter() - start)
    flash, onednn = (statistics.median(seconds[name]) for name in ("flash", "onednn"))
    choice: Literal["onednn", "flash"] = "flash" if flash < 0.9 * onednn else "onednn"
    log.info(
        "attention over %d frames: %s (%d heads: flash %.1f ms, oneDNN %.1f ms)",
        frames, choice, heads, flash * 1000, onednn * 1000,
    )  # fmt: skip
    return choice


def _onednn_attention_applies(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and packing_available()


def _flash_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    b, h, t, dh = q.shape
    out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    return out.transpose(1, 2).reshape(b, t, h * dh)


def _onednn_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Per row and head, blocks of query rows through oneDNN's products (keys and transposed
    values made contiguous once: a strided "weight" sends oneDNN down a path ~2000x slower)."""
    b, h, t, dh = q.shape
    product = torch.ops.mkldnn._linear_pointwise
    keys = k.contiguous()
    values_t = v.transpose(-1, -2).contiguous()  # [B, H, Dh, T]
    out = q.new_empty(b, t, h, dh)
    for row in range(b):
        for head in range(h):
            for start in range(0, t, ATTENTION_BLOCK_ROWS):
                stop = min(start + ATTENTION_BLOCK_ROWS, t)
                scores = product(q[row, head, start:stop], keys[row, head], None, "none", [], "")
                weights = torch.softmax(scores, dim=-1)
                out[row, start:stop, head] = product(weights, values_t[row, head], None, "none", [], "")
    return out.view(b, t, h * dh)
