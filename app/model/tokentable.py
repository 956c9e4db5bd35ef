"""The decoder's token table held once, where its checkpoint allows it: lookups and the vocabulary projection.

Whisper ties its vocabulary projection to its token embeddings: logits = hidden . E^T. An fp32 CPU decoder used to
hold the table twice, a plain copy for lookups and oneDNN's packed copy for the projection (2 x 106 MB for Whisper
base). The converted checkpoints store E in fp16, so the fp32 table is an exact upcast: `share_table` keeps E once,
in fp16, in the kernel's blocks (`app.model.halflinear`), and both the lookups (`HalfTokenTable`) and the
projection (a `HalfLinear` over the same blocks) read them.

Where the table is not tied, not exact in fp16, or the kernel does not run, `compact_table` keeps what it can:
the lookup table in fp16 once the projection has its own copy.

Shapes: V vocabulary, D model width, B = ceil(V / 16) blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from app.model.halflinear import BLOCK, HalfLinear, half_blocks, unblocked
from app.model.native import kernel_extension


class HalfTokenTable(nn.Module):
    """A token table [V, D] held in fp16 as the kernel's blocks [B, D, 16]; called, it looks tokens up.

    tokens [...] int64 -> embeddings [..., D] fp16 (exact: cast them to the decoder's dtype).
    """

    blocks: Tensor

    def __init__(self, blocks: Tensor, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.register_buffer("blocks", blocks, persistent=False)

    @property
    def num_embeddings(self) -> int:
        return self.vocab

    @property
    def embedding_dim(self) -> int:
        return self.blocks.shape[1]

    @property
    def weight(self) -> Tensor:
        """The table [V, D] in fp16 (a copy)."""
        return unblocked(self.blocks, self.vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.blocks[tokens // BLOCK, :, tokens % BLOCK]

    def extra_repr(self) -> str:
        return f"{self.vocab}, {self.embedding_dim}, fp16 blocks shared with the projection"


def share_table(decoder: nn.Module) -> bool:
    """Make an fp32 CPU decoder's tied projection and its lookups read one fp16 table; returns whether it did. Not
    where the projection is untied or already replaced, the table is not exact in fp16, or the kernel library does
    not run."""
    embed, proj = decoder.get_submodule("embed"), decoder.get_submodule("proj")
    if not isinstance(embed, nn.Embedding) or type(proj) is not nn.Linear or proj.weight is not embed.weight:
        return False
    table = embed.weight
    if table.dtype != torch.float32 or table.device.type != "cpu" or kernel_extension() is None:
        return False
    blocks = half_blocks(table.detach())
    if blocks is None:
        return False
    decoder.embed = HalfTokenTable(blocks, table.shape[0])
    decoder.proj = HalfLinear(blocks, table.shape[0])
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
