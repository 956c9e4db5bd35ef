"""A lean Whisper audio encoder: two convolutions, N pre-norm self-attention blocks, a final norm.

The same function as transformers' `WhisperEncoder`, laid out for the kernels in
`app.model.kernels`: fused q/k/v projection (with the query scale folded into its weights,
exact for Whisper's power-of-two head size), residual sums and the feed-forward activation
fused into the products where the linears are packed, and the self-attention through whichever
of oneDNN's per-head products and torch's flash kernel runs faster on this CPU.

Shapes: B batch rows, M mel bins, F = 3000 mel frames, T = 1500 encoder frames, D width,
H heads, Dh head size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.model.kernels import AttentionKernel, attention, linear_add, linear_gelu, preferred_attention
from app.model.weights import Tensors, WhisperDims, assign, fused, renamed

# (this module's name, the transformers checkpoint's) of an encoder layer's plain Linears and norms
_LAYER_NAMES = (
    ("attn_out", "self_attn.out_proj"),
    ("attn_norm", "self_attn_layer_norm"),
    ("fc1", "fc1"),
    ("fc2", "fc2"),
    ("ffn_norm", "final_layer_norm"),
)


class EncoderLayer(nn.Module):
    """Pre-norm block: self-attention over all frames, then the feed-forward."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)  # query rows pre-scaled by Dh^-0.5
        self.attn_out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def forward(self, x: Tensor, attention_kernel: AttentionKernel = "auto") -> Tensor:
        """[B, T, D] -> [B, T, D]."""
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, Dh]
        x = linear_add(self.attn_out, attention(q, k, v, attention_kernel), x)
        x = linear_add(self.fc2, linear_gelu(self.fc1, self.ffn_norm(x)), x)
        if x.dtype == torch.float16:  # as transformers does, keep fp16 activations finite
            bound = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-bound, bound)
        return x


class AudioEncoder(nn.Module):
    """Log-mel [B, M, F] -> encoder states [B, T, D].

    `attention_kernel` picks the self-attention's kernel (`app.model.kernels.attention`); `rows_per_pass`
    (None: all) runs a batch's windows that many at a time. Each row's states are the same bits either way.
    """

    def __init__(self, n_mels: int, d_model: int, n_heads: int, ffn_dim: int, n_layers: int, n_frames: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attention_kernel: AttentionKernel = "auto"
        self.rows_per_pass: int | None = None
        self.conv1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.positions = nn.Parameter(torch.zeros(n_frames, d_model), requires_grad=False)
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_heads, ffn_dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)

    @property
    def n_frames(self) -> int:
        return self.positions.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in (its weights'; `load_model(encoder_dtype=...)` may set it apart)."""
        return self.positions.dtype

    def attention_in_use(self) -> str:
        """The self-attention kernel this encoder runs ("onednn" or "flash"; for "auto", the one
        timed faster when it first ran, or timed now if it has not run)."""
        heads, d_model = self.n_heads, self.positions.shape[1]
        queries = self.positions.new_empty(1, heads, self.n_frames, d_model // heads)
        return preferred_attention(queries, self.attention_kernel)

    @classmethod
    def from_weights(cls, dims: WhisperDims, tensors: Tensors) -> AudioEncoder:
        """Build from a checkpoint's `model.encoder.*` tensors (their dtype and device)."""
        with torch.device("meta"):
            enc = cls(
                n_mels=dims.num_mel_bins,
                d_model=dims.d_model,
                n_heads=dims.encoder_attention_heads,
                ffn_dim=dims.encoder_ffn_dim,
                n_layers=dims.encoder_layers,
                n_frames=dims.max_source_positions,
            )
        src = "model.encoder."
        state = {"positions": tensors[f"{src}embed_positions.weight"]}
        state |= renamed(tensors, [("conv1", "conv1"), ("conv2", "conv2"), ("norm", "layer_norm")], theirs=src)
        query_scale = (dims.d_model // dims.encoder_attention_heads) ** -0.5
        for i in range(dims.encoder_layers):
            mine, theirs = f"layers.{i}.", f"{src}layers.{i}."
            state |= renamed(tensors, _LAYER_NAMES, mine, theirs)
            qkv = [f"{theirs}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
            state |= fused(tensors, f"{mine}qkv", qkv, [query_scale, 1.0, 1.0])
        assign(enc, state)
        return enc.eval()

    def forward(self, features: Tensor, between_layers: Callable[[], None] | None = None) -> Tensor:
        """Log-mel [B, M, F] -> [B, T, D]; `between_layers()` is called after each layer (it may raise, to stop)."""
        expected = 2 * self.n_frames
        if features.shape[-1] != expected:
            raise ValueError(f"the encoder takes {expected} mel frames (one 30-s window), got {features.shape[-1]}")
        rows = self.rows_per_pass
        if rows is not None and features.shape[0] > rows:
            return torch.cat([self._pass(part, between_layers) for part in features.split(rows)])
        return self._pass(features, between_layers)

    def _pass(self, features: Tensor, between_layers: Callable[[], None] | None) -> Tensor:
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x))
        x = x.transpose(1, 2) + self.positions
        for layer in self.layers:
            x = layer(x, self.attention_kernel)
            if between_layers is not None:
                between_layers()
        return cast(Tensor, self.norm(x))
