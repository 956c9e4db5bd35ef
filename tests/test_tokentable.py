"""fp16 weights on the kernel (app/model/halflinear.py) and the token table held once (app/model/tokentable.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.model.decoder import TextDecoder
from app.model.halflinear import HalfLinear, half_blocks, halve_linears
from app.model.native import kernel_extension
from app.model.tokentable import HalfTokenTable, compact_table, share_table
from app.model.whisper import WhisperModel

needs_kernel = pytest.mark.skipif(kernel_extension() is None, reason="the kernel library does not run on this CPU")


def _half_decoder(vocab: int = 83, width: int = 32) -> TextDecoder:
    """A small decoder whose tied table fp16 holds exactly (83 tokens: five whole blocks and a part)."""
    decoder = TextDecoder(vocab=vocab, d_model=width, n_heads=2, ffn_dim=16, n_layers=1, n_positions=4)
    with torch.no_grad():
        decoder.embed.weight.copy_(decoder.embed.weight.half().float())
    return decoder


@needs_kernel
def test_the_projection_gives_each_row_the_same_bits_in_any_call_and_on_either_instruction_set() -> None:
    """Each logit is one chain of FMAs in order: a row alone, among up to 13 others (whole tiles and every remainder
    of rows and blocks), and on AVX2 or AVX-512 gets the same bits, within fp32 rounding of the exact product."""
    ext = kernel_extension()
    decoder = _half_decoder(vocab=1000 * 16 + 7, width=64)
    table = decoder.embed.weight.detach().clone()
    assert share_table(decoder)
    proj = decoder.proj
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(13, 64, generator=generator) * 3
    exact = x.double() @ table.double().T
    isa = ext.isa()
    try:
        for name in ("avx2", "avx512_vnni") if isa == "avx512_vnni" else ("avx2",):
            ext.use_isa(name)
            whole = proj(x)
            torch.testing.assert_close(whole.double(), exact, rtol=1e-5, atol=1e-4)
            for rows in range(1, 13):
                assert torch.equal(proj(x[:rows]), whole[:rows]), (name, rows)
            alone = torch.cat([proj(x[i : i + 1]) for i in range(13)])
            assert torch.equal(alone, whole), name
            if name == "avx2":
                first = whole
            else:
                assert torch.equal(whole, first)
    finally:
        ext.use_isa(isa)
    assert proj(x.view(13, 1, 64)).shape == (13, 1, 1000 * 16 + 7)


@needs_kernel
def test_lookups_and_projection_read_one_fp16_table_and_give_the_upcast_rows() -> None:
    decoder = _half_decoder()
    table = decoder.embed.weight.detach().clone()
    assert share_table(decoder)
    assert isinstance(decoder.embed, HalfTokenTable) and isinstance(decoder.proj, HalfLinear)
    assert decoder.proj.blocks.data_ptr() == decoder.embed.blocks.data_ptr()
    assert decoder.embed.blocks.dtype == torch.float16 and decoder.embed.blocks.shape == (6, 32, 16)
    tokens = torch.tensor([[0, 15, 16, 82], [81, 3, 47, 64]])
    assert torch.equal(decoder.embed(tokens).float(), table[tokens])
    assert torch.equal(decoder.proj.weight, table)
    assert decoder.vocab_size == 83 and decoder.d_model == 32
    assert not compact_table(decoder)  # nothing left to compact


def test_a_table_fp16_cannot_hold_or_an_untied_projection_keeps_its_fp32_path() -> None:
    inexact = _half_decoder()
    with torch.no_grad():
        inexact.embed.weight[3, 5] = 1 + 2**-20  # not a half-precision number
    assert not share_table(inexact) and type(inexact.proj) is nn.Linear
    assert inexact.proj.weight is inexact.embed.weight
    assert not compact_table(inexact)  # the tied projection reads the table itself
    untied = _half_decoder()
    untied.proj = nn.Linear(32, 83, bias=False)
    assert not share_table(untied)
    assert compact_table(untied) and untied.embed.weight.dtype == torch.float16


def test_the_loaded_model_holds_its_token_table_once(base: WhisperModel) -> None:
    """Loaded on a CPU with the kernel, Whisper base's tied projection reads the lookups' fp16 blocks (53 MB, where
    two fp32 copies took 2 x 106 MB); elsewhere the lookups keep an fp16 table and the projection its own copy."""
    decoder = base.decoder
    ids = torch.arange(0, decoder.vocab_size, 97)
    with torch.inference_mode():
        lookups = decoder.embed(ids).float()
        assert torch.equal(lookups, decoder.proj.weight[ids])
    if kernel_extension() is not None:
        assert isinstance(decoder.proj, HalfLinear)
        assert decoder.proj.blocks.data_ptr() == decoder.embed.blocks.data_ptr()
        assert decoder.embed.blocks.numel() == -(-decoder.vocab_size // 16) * 16 * decoder.d_model
    else:
        assert decoder.embed.weight.dtype == torch.float16


@needs_kernel
def test_a_half_linear_adds_its_bias_after_the_sum_and_keeps_each_rows_bits() -> None:
    """Every product shape of a decoder layer (1536, 512 and 2048 outputs; 512 and 2048 inputs), and a width that
    ends in a part of a block: close to the exact product, each row the same bits alone, in any row count."""
    generator = torch.Generator().manual_seed(1)
    for inputs, outputs in ((512, 1536), (2048, 512), (512, 2048), (64, 83)):
        linear = nn.Linear(inputs, outputs)
        with torch.no_grad():
            linear.weight.copy_(linear.weight.half().float())
            linear.bias.normal_(generator=generator)
        half = HalfLinear.of(linear)
        assert half is not None and half.bias is not None
        x = torch.randn(9, inputs, generator=generator)
        whole = half(x)
        exact = x.double() @ linear.weight.double().T + linear.bias.double()
        torch.testing.assert_close(whole.double(), exact, rtol=1e-5, atol=1e-4)
        assert torch.equal(torch.cat([half(x[i : i + 1]) for i in range(9)]), whole)
        assert torch.equal(half(x[:7]), whole[:7])
        assert torch.equal(half.weight, linear.weight)


def test_halving_takes_the_exact_untied_linears_it_is_allowed() -> None:
    """`halve_linears` leaves a weight fp16 cannot hold, a skipped name, and the tied projection (which
    `share_table` shares its own way); `half_blocks` refuses an inexact weight."""
    decoder = _half_decoder()
    with torch.no_grad():
        for linear in decoder.modules():
            if isinstance(linear, nn.Linear):
                linear.weight.copy_(linear.weight.half().float())
        decoder.layers[0].fc1.weight[0, 0] = 1 + 2**-20
    assert half_blocks(decoder.layers[0].fc1.weight) is None
    count = halve_linears(decoder, skip=lambda name: name.endswith(".cross_kv"))
    layer = decoder.layers[0]
    kinds = {name: type(m).__name__ for name, m in layer.named_children() if "norm" not in name}
    if kernel_extension() is None:
        assert count == 0
        return
    assert kinds["fc1"] == "Linear" and kinds["cross_kv"] == "Linear" and kinds["fc2"] == "HalfLinear"
    assert kinds["qkv"] == "HalfLinear" and count == sum(k == "HalfLinear" for k in kinds.values())
    assert type(decoder.proj) is nn.Linear and decoder.proj.weight is decoder.embed.weight
