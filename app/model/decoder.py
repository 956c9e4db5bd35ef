"""A lean Whisper text decoder with a ragged, per-row key/value cache.

The same module runs the main model (fp32/fp16/bf16) and the drafts (for example the int8
copy of `app.engine.drafting.int8.int8_draft_decoder`, which computes in fp32). Rows of a
batch may sit at different positions and feed different numbers of tokens in one call; each
row writes its keys and values at its own positions and attends only to positions at or before
its own (`key_position <= query_position`). Entries past a row's valid length are
stale but never read before being overwritten, so rejecting drafted tokens is just
a matter of moving the row's length back.

Shapes: B batch rows, S tokens fed per row in one call, H heads, Dh head size,
D model width, T encoder frames, C cache capacity, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.model.kernels import DecoderAttention, invariant_attention_runs, prefix_attention
from app.model.weights import Tensors, WhisperDims, assign, fused, renamed

# A lone row feeding at most this many tokens takes the one-call step column by column. A draft's
# module path, 1500 audio frames, 1 / 2 / 3 tokens: 3.5 / 4.4 / 4.6 ms; the one-call step 1.4 /
# 2.4 / 3.2 ms. Batches read the frames in fp32 rather than a lone row's bfloat16 copy, and at 4
# rows two tokens cost the same either way and three more in columns: they take it for 1 token only.
LONE_ROW_MAX_FEED = 3


@dataclass
class AttentionCapture:
    """Cross-attention scores to keep from one feed (word alignment): `heads` {layer: [head, ...]}; once fed,
    `scores` {layer: [B, len(heads), S, T]}, before the softmax. Every layer then computes its scores in full, as
    OpenAI's alignment does, but only these heads' are kept (all six layers' of a 150-token chunk in Whisper base
    held ~43 MB)."""

    heads: dict[int, list[int]]
    scores: dict[int, Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> AttentionCapture:
        """To keep the scores of these (layer, head) pairs."""
        heads: dict[int, list[int]] = {}
        for layer, head in pairs:
            heads.setdefault(layer, []).append(head)
        return cls(heads)

    def head(self, layer: int, head: int) -> Tensor:
        """One kept head's scores, once fed: [B, S, T]."""
        return self.scores[layer][:, self.heads[layer].index(head)]


@dataclass
class KVCache:
    """Self-attention keys/values per layer: [B, H, C, Dh]. Slot C-1 is a scratch slot for padding."""

    keys: list[Tensor]
    values: list[Tensor]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def scratch(self) -> int:
        return self.capacity - 1

    def gather(self, rows: Tensor, length: int) -> KVCache:
        """A cache of the same capacity whose row i holds the first `length` slots of row `rows[i]` (a row may be
        taken more than once: hypotheses of a beam share their prefix); the other slots are left unset."""

        def take(t: Tensor) -> Tensor:
            out = t.new_empty((rows.shape[0], *t.shape[1:]))
            out[:, :, :length] = t[:, :, :length].index_select(0, rows)
            return out

        return KVCache([take(k) for k in self.keys], [take(v) for v in self.values])


@dataclass
class CrossKV:
    """Cross-attention keys/values per layer, computed once per request: [E, H, T, Dh] for E entries (clips).

    Row b of a batch reads entry b, or entry owners[b] when `owners` is set: rows of one request (the hypotheses
    of a beam, its samples) share its entry without copying it. The decoder then attends run by run of rows
    that read one entry (`runs`), each over views of it.
    """

    keys: list[Tensor]
    values: list[Tensor]
    owners: tuple[int, ...] | None = None
    _views: dict[tuple[int, int], CrossKV] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch(self) -> int:
        """Rows of a batch that read these keys/values."""
        return len(self.owners) if self.owners is not None else self.keys[0].shape[0]

    def owner(self, row: int) -> int:
        return self.owners[row] if self.owners is not None else row

    def select(self, rows: Tensor) -> CrossKV:
        """Keep only `rows` (a [B'] index tensor): copies, unless rows share entries (`owners`)."""
        if self.owners is not None:
            return self.rows(rows.tolist())
        return CrossKV([k.index_select(0, rows) for k in self.keys], [v.index_select(0, rows) for v in self.values])

    def rows(self, index: Sequence[int]) -> CrossKV:
        """Row i reads what row index[i] reads now; no copy (this very object when nothing changes)."""
        owners = [self.owner(i) for i in index]
        if owners == list(range(self.keys[0].shape[0])):
            return self if self.owners is None else CrossKV(self.keys, self.values, None, self._views)
        return CrossKV(self.keys, self.values, tuple(owners), self._views)

    def runs(self) -> list[tuple[int, int, int]]:
        """(entry, first row, end row) of each run of consecutive rows that read one entry."""
        owners = self.owners if self.owners is not None else tuple(range(self.keys[0].shape[0]))
        out: list[tuple[int, int, int]] = []
        for row, entry in enumerate(owners):
            if out and out[-1][0] == entry and out[-1][2] == row:
                out[-1] = (entry, out[-1][1], row + 1)
            else:
                out.append((entry, row, row + 1))
        return out

    def entry(self, entry: int, rows: int) -> CrossKV:
        """Views of one entry for `rows` rows (kept: a drafting kernel keeps copies keyed by the object)."""
        key = (entry, rows)
        if key not in self._views:
            self._views[key] = CrossKV(
                [k[entry : entry + 1].expand(rows, -1, -1, -1) for k in self.keys],
                [v[entry : entry + 1].expand(rows, -1, -1, -1) for v in self.values],
            )
        return self._views[key]

    def frames(self, n: int, dtype: torch.dtype) -> CrossKV:
        """The first n frames of each entry in `dtype` (views when already of that type), read by the same rows."""
        return CrossKV(
            [k[:, :, :n].to(dtype) for k in self.keys], [v[:, :, :n].to(dtype) for v in self.values], self.owners
        )


# (this module's name, the transformers checkpoint's) of a decoder layer's plain Linears and norms
_LAYER_NAMES = (
    ("self_out", "self_attn.out_proj"),
    ("self_norm", "self_attn_layer_norm"),
    ("cross_q", "encoder_attn.q_proj"),
    ("cross_out", "encoder_attn.out_proj"),
    ("cross_norm", "encoder_attn_layer_norm"),
    ("fc1", "fc1"),
    ("fc2", "fc2"),
    ("ffn_norm", "final_layer_norm"),
)


class DecoderLayer(nn.Module):
    """Pre-norm block: causal self-attention, cross-attention, feed-forward (fused projections)."""

    def __init__(self, d_model: int, n_heads: int, ffn_dim: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.self_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.self_out = nn.Linear(d_model, d_model)
        self.cross_norm = nn.LayerNorm(d_model)
        self.cross_q = nn.Linear(d_model, d_model)
        self.cross_kv = nn.Linear(d_model, 2 * d_model)
        self.cross_out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        """[B, S, D] -> [B, H, S, Dh]."""
        b, s, d = x.shape
        return x.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2)

    def project_cross(self, encoder_out: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T, D] -> keys, values [B, H, T, Dh], each head's frames contiguous.

        Every pass reads them head by head: as views of the projection, a head's frames would lie
        2 * D floats apart, and a pass over them took twice as long on a CPU (Whisper base, 1500 frames).
        """
        k, v = self.cross_kv(encoder_out).chunk(2, dim=-1)
        return self._heads(k).contiguous(), self._heads(v).contiguous()

    def forward(
        self,
        x: Tensor,
        lengths: Tensor,
        write_index: Tensor,
        cache_k: Tensor,
        cache_v: Tensor,
        kv_len: int,
        cross_k: Tensor,
        cross_v: Tensor,
        attention: DecoderAttention = "invariant",
        capture: list[Tensor] | None = None,
        cross_runs: list[tuple[int, int, int]] | None = None,
        capture_heads: Sequence[int] = (),
    ) -> Tensor:
        """x [B, S, D]; lengths [B, S]: the keys each token sees (its position + 1). cross_k/cross_v [E, H, T, Dh]:
        row b reads entry b, or with `cross_runs` ((entry, first row, end row), `CrossKV.runs`) its run's entry.

        `capture`, when given: the cross-attention's scores are computed in full, and those of `capture_heads`
        appended to it [B, len(capture_heads), S, T] (before the softmax).
        """
        b, s, d = x.shape
        q, k, v = self.qkv(self.self_norm(x)).chunk(3, dim=-1)
        cache_k.scatter_(2, write_index, self._heads(k))
        cache_v.scatter_(2, write_index, self._heads(v))
        attn = prefix_attention(q, cache_k[:, :, :kv_len], cache_v[:, :, :kv_len], lengths, attention)
        x = x + self.self_out(attn)
        q = self.cross_q(self.cross_norm(x))
        if capture is None and cross_runs is not None:
            # The queries of a run's rows as one row's: the kernel then reads each head's frames once for all of
            # them (neighbouring queries share their keys), not once per row; each query gets the same bits.
            attn = torch.cat(
                [
                    prefix_attention(
                        q[a:z].reshape(1, (z - a) * s, d), cross_k[e : e + 1], cross_v[e : e + 1], None, attention
                    ).view(z - a, s, d)
                    for e, a, z in cross_runs
                ]
            )
        elif capture is None:
            attn = prefix_attention(q, cross_k, cross_v, None, attention)
        else:
            heads = self._heads(q)
            scale = heads.shape[-1] ** -0.25  # on both sides, as OpenAI's model computes them
            scores = (heads * scale) @ (cross_k * scale).transpose(-1, -2)
            if capture_heads:
                capture.append(scores[:, list(capture_heads)])
            attn = (scores.softmax(-1) @ cross_v).transpose(1, 2).reshape(b, s, d)
        x = x + self.cross_out(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ffn_norm(x))))


class TextDecoder(nn.Module):
    """Whisper's text decoder: token + position embeddings, N layers, final norm, vocabulary projection."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, ffn_dim: int, n_layers: int, n_positions: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_positions = n_positions
        embed = torch.empty(vocab, d_model)
        if embed.device.type != "meta":  # on meta (`from_weights`), `normal_` would import torch._dynamo: ~2 s
            nn.init.normal_(embed)
        self.embed = nn.Embedding(vocab, d_model, _weight=embed)
        self.positions = nn.Parameter(torch.zeros(n_positions, d_model))
        self.layers = nn.ModuleList(DecoderLayer(d_model, n_heads, ffn_dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        proj = nn.Linear(d_model, vocab, bias=False)
        proj.weight = self.embed.weight
        self.proj: nn.Module = proj  # an int8 module in a drafting copy
        # "invariant": every token fed gets the same bits whatever else a pass feeds (`prefix_attention`).
        self.attention: DecoderAttention = "invariant"
        # A drafting copy on the int8 kernel runs one token per row through all layers in one call.
        self.token_step: Callable[[Tensor, list[int], list[int], KVCache, CrossKV], Tensor] | None = None

    @property
    def d_model(self) -> int:
        return self.embed.embedding_dim

    @property
    def vocab_size(self) -> int:
        return self.embed.num_embeddings

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its activations and self-attention cache (fp32 for an int8 drafting copy)."""
        return self.positions.dtype

    def attention_in_use(self) -> DecoderAttention:
        """What its attention runs here: "invariant" (this project's kernel) or torch's "sdpa"."""
        runs = invariant_attention_runs(self.positions.device, self.dtype, self.d_model // self.n_heads)
        return "invariant" if self.attention == "invariant" and runs else "sdpa"

    @classmethod
    def from_weights(cls, dims: WhisperDims, tensors: Tensors) -> TextDecoder:
        """Build from a checkpoint's `model.decoder.*` tensors (and `proj_out.weight` where untied)."""
        with torch.device("meta"):
            dec = cls(
                vocab=dims.vocab_size,
                d_model=dims.d_model,
                n_heads=dims.decoder_attention_heads,
                ffn_dim=dims.decoder_ffn_dim,
                n_layers=dims.decoder_layers,
                n_positions=dims.max_target_positions,
            )
        src = "model.decoder."
        tied = dims.tie_word_embeddings or "proj_out.weight" not in tensors
        embed = tensors[f"{src}embed_tokens.weight"]
        state = {
            "embed.weight": embed,
            "positions": tensors[f"{src}embed_positions.weight"],
            "proj.weight": embed if tied else tensors["proj_out.weight"],
        }
        state |= renamed(tensors, [("norm", "layer_norm")], theirs=src)
        for i in range(dims.decoder_layers):
            mine, theirs = f"layers.{i}.", f"{src}layers.{i}."
            state |= renamed(tensors, _LAYER_NAMES, mine, theirs)
            state |= fused(tensors, f"{mine}qkv", [f"{theirs}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
            state |= fused(tensors, f"{mine}cross_kv", [f"{theirs}encoder_attn.{p}" for p in ("k_proj", "v_proj")])
        assign(dec, state)
        if tied:
            cast(nn.Linear, dec.proj).weight = dec.embed.weight
        return dec.eval()

    def cross_kv(self, encoder_out: Tensor) -> CrossKV:
        keys, values = [], []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            k, v = layer.project_cross(encoder_out)
            keys.append(k)
            values.append(v)
        return CrossKV(keys, values)

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device, capacity: int | None = None) -> KVCache:
        capacity = (capacity or self.n_positions) + 1  # + the scratch slot
        head_dim = self.d_model // self.n_heads
        shape = (batch, self.n_heads, capacity, head_dim)
        return KVCache(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
        )

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        real: Tensor,
        cache: KVCache,
        cross: CrossKV,
        capture: AttentionCapture | None = None,
    ) -> Tensor:
        """Feed tokens [B, S] at positions [B, S]; `real` [B, S] is False for padding; `capture`: the cross-attention
        scores to keep.

        Returns the final hidden states [B, S, D]; padding rows hold garbage.
        Padding is written to the cache's scratch slot and attends like the row's last real token.
        """
        b, s = tokens.shape
        x = self.embed(tokens).to(self.dtype) + self.positions[positions]
        write = torch.where(real, positions, torch.full_like(positions, cache.scratch))
        if self.token_step is not None and capture is None and (s == 1 or (b == 1 and s <= LONE_ROW_MAX_FEED)):
            # One token per row (draft steps), or a few for a lone row (the first draft step after a
            # verification feeds what the main model accepted): all layers in one call per column. The
            # columns run in order, so each token attends to what the ones before it just wrote.
            pos, wr = positions.tolist(), write.tolist()
            step = self.token_step
            if cross.owners is None:
                steps = [step(x[:, j], [p[j] for p in pos], [w[j] for w in wr], cache, cross) for j in range(s)]
            else:  # run by run of rows that read one entry, over views of it and of their cache rows
                steps = []
                for j in range(s):
                    parts = []
                    for e, a, z in cross.runs():
                        part = KVCache([k[a:z] for k in cache.keys], [v[a:z] for v in cache.values])
                        rows_pos, rows_wr = [p[j] for p in pos[a:z]], [w[j] for w in wr[a:z]]
                        parts.append(step(x[a:z, j], rows_pos, rows_wr, part, cross.entry(e, z - a)))
                    steps.append(torch.cat(parts))
            return self.norm(torch.stack(steps, dim=1))
        kv_len = int(positions.max()) + 1
        head_dim = self.d_model // self.n_heads
        write_index = write.view(b, 1, s, 1).expand(b, self.n_heads, s, head_dim)
        lengths = positions + 1  # the keys each token sees
        for i, layer in enumerate(self.layers):
            kept: list[Tensor] | None = None if capture is None else []
            x = layer(
                x,
                lengths,
                write_index,
                cache.keys[i],
                cache.values[i],
                kv_len,
                cross.keys[i],
                cross.values[i],
                self.attention,
                kept,
                cross.runs() if cross.owners is not None else None,
                capture.heads.get(i, ()) if capture is not None else (),
            )
            if capture is not None and kept:
                capture.scores[i] = kept[0]
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., D] -> [..., V] in float32."""
        return self.proj(hidden).float()
