"""The decoder's token table held once, where its checkpoint allows it: lookups and the vocabulary projection.

Whisper ties its vocabulary projection to its token embeddings: logits = hidden . E^T. An fp32 CPU decoder used to
hold the table twice, a plain copy for lookups and oneDNN's packed copy for the projection (2 x 101 MB for Whisper
base). The converted checkpoints store E in fp16, so the fp32 table is an exact upcast: `share_table` keeps E once,
in fp16, in the blocks this project's kernel reads (`HalfTokenTable`), and both the lookups and the projection
(`TiedProjection`) read them. The kernel sums each logit as one chain of FMAs over the hidden state in order, from
fp16 weights widened exactly, so a row's logits are the same bits whatever else a pass holds (the decoder stays
batch-invariant) and read half the bytes oneDNN's fp32 copy did.

Where the table is not tied, not exact in fp16, or the kernel does not run, `compact_table` keeps what it can:
the lookup table in fp16 once the projection has its own copy.

Shapes: V vocabulary, D model width, B = ceil(V / 16) blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from app.model.native import kernel_extension

BLOCK = 16  # outputs side by side in the kernel's table (`half_linear.inc`)


class HalfTokenTable(nn.Module):
    """A token table [V, D] held in fp16 as the kernel's blocks [B, D, 16]; called, it looks tokens up.

    tokens [...] int64 -> embeddings [..., D] fp16 (exact: cast them to the decoder's dtype).
    """

    blocks: Tensor

    def __init__(self, blocks: Tensor, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.register_buffer("blocks", blocks, persistent=False)

    @classmethod
    def from_table(cls, table: Tensor, rows: int = 4096) -> HalfTokenTable | None:
        """The table [V, D] in blocks, or None where some entry is not a half-precision number. Filled `rows`
        tokens at a time, so no second full-size copy is ever made."""
        vocab, width = table.shape
        blocks = torch.zeros(-(-vocab // BLOCK), width, BLOCK, dtype=torch.float16)
        rows -= rows % BLOCK
        with torch.no_grad():
            for start in range(0, vocab, rows):
                part = table[start : start + rows]
                half = part.half()
                if not torch.equal(half.float(), part.float()):
                    return None
                padded = torch.zeros(-(-half.shape[0] // BLOCK) * BLOCK, width, dtype=torch.float16)
                padded[: half.shape[0]] = half
                first = start // BLOCK
                blocks[first : first + padded.shape[0] // BLOCK] = padded.view(-1, BLOCK, width).transpose(1, 2)
        return cls(blocks, vocab)

    @property
    def num_embeddings(self) -> int:
        return self.vocab

    @property
    def embedding_dim(self) -> int:
        return self.blocks.shape[1]

    @property
    def weight(self) -> Tensor:
        """The table [V, D] in fp16 (a copy)."""
        return self.blocks.transpose(1, 2).reshape(-1, self.embedding_dim)[: self.vocab]

    def forward(self, tokens: Tensor) -> Tensor:
        return self.blocks[tokens // BLOCK, :, tokens % BLOCK]

    def extra_repr(self) -> str:
        return f"{self.vocab}, {self.embedding_dim}, fp16 blocks shared with the projection"


class TiedProjection(nn.Module):
    """The vocabulary projection over a `HalfTokenTable`: hidden [..., D] fp32 -> logits [..., V] fp32, on the kernel
    library's `half_linear`. Reads the table's blocks; holds nothing of its own."""

    blocks: Tensor
    bias = None

    def __init__(self, table: HalfTokenTable) -> None:
        super().__init__()
        self.in_features = table.embedding_dim
        self.out_features = table.vocab
        self.register_buffer("blocks", table.blocks, persistent=False)

    @property
    def weight(self) -> Tensor:
        """The weight [V, D] in fp32 (a copy: for quantizing a draft's twin of it)."""
        return self.blocks.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].float()

    def forward(self, hidden: Tensor) -> Tensor:
        ext = kernel_extension()
        assert ext is not None, "a TiedProjection is made only where the kernel library runs"
        return ext.half_linear(hidden.float(), self.blocks, self.out_features)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, the token table's fp16 blocks"


def share_table(decoder: nn.Module) -> bool:
    """Make an fp32 CPU decoder's tied projection and its lookups read one fp16 table (`HalfTokenTable`); returns
    whether it did. Not where the projection is untied or already replaced, the table is not exact in fp16, or the
    kernel library does not run."""
    embed, proj = decoder.get_submodule("embed"), decoder.get_submodule("proj")
    if not isinstance(embed, nn.Embedding) or type(proj) is not nn.Linear or proj.weight is not embed.weight:
        return False
    table = embed.weight
    if table.dtype != torch.float32 or table.device.type != "cpu" or kernel_extension() is None:
        return False
    half = HalfTokenTable.from_table(table)
    if half is None:
        return False
    decoder.embed = half
    decoder.proj = TiedProjection(half)
    return True


def compact_table(decoder: nn.Module, rows: int = 4096) -> bool:
    """Keep the token table, once it serves lookups only, in half precision where that holds it exactly: a
    checkpoint stored in fp16 (as the converted ones are) upcasts exactly, so the lookups give the same fp32
    bits from half the memory (50 MB for Whisper base). Not while the projection reads the table itself (a
    tied fp32 `nn.Linear`: packed, it has its own copy). Returns whether it did."""
    embed, proj = decoder.get_submodule("embed"), decoder.get_submodule("proj")
    if not isinstance(embed, nn.Embedding):
        return False
    table = embed.weight
    reads_table = isinstance(proj, nn.Linear) and proj.weight is table
    if table.dtype != torch.float32 or table.device.type != "cpu" or reads_table:
        return False
    half = torch.empty(table.shape, dtype=torch.float16)
    with torch.no_grad():
        for start in range(0, table.shape[0], rows):  # a block at a time: no second fp32 table, even briefly
            block = table[start : start + rows]
            half[start : start + rows] = block
            if not torch.equal(half[start : start + rows].float(), block):
                return False
    embed.weight = nn.Parameter(half, requires_grad=False)
    return True
