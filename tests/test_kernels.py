"""The CPU kernels and the lean encoder against torch's and transformers' reference arithmetic."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app.model import kernels, tuning
from app.model.encoder import AudioEncoder
from app.model.features import N_FFT, N_SAMPLES, SAMPLE_RATE, log_mel, mel_filters, window
from app.model.kernels import (
    ATTENTION_KERNELS,
    PackedLinear,
    attention,
    linear_add,
    linear_gelu,
    pack_linears,
    packing_available,
    preferred_attention,
    prefix_attention,
)
from app.model.native import cpu_runs_kernel, kernel_extension
from app.model.weights import WhisperDims
from app.model.whisper import WhisperModel

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filterbank_equals_transformers(n_mels: int) -> None:
    """The engine's own filterbank (Whisper's 80 bins, large-v3's 128) is transformers' to the bit."""
    from transformers.audio_utils import mel_filter_bank

    reference = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    assert torch.equal(mel_filters(n_mels), torch.from_numpy(np.asarray(reference, dtype=np.float32)).T)


@needs_onednn
def test_packed_linear_and_fused_epilogues_match_torch() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    packed = PackedLinear(copy.deepcopy(linear))
    for rows in (1, 3, 7, 300):
        x = torch.randn(2, rows, 96)
        residual = torch.randn(2, rows, 160)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(linear_gelu(packed, x), F.gelu(linear(x)), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(linear_add(packed, x, residual), residual + linear(x), rtol=1e-5, atol=1e-5)
    # The plain fallbacks are the same functions.
    x = torch.randn(4, 96)
    with torch.no_grad():
        torch.testing.assert_close(linear_gelu(linear, x), F.gelu(linear(x)))
    # A packed layer still saves, copies and quantizes as a plain linear.
    assert torch.equal(packed.state_dict()["weight"], linear.weight.detach())
    assert type(copy.deepcopy(packed)) is nn.Linear


@needs_onednn
@pytest.mark.parametrize("frames", [1500, 37])
def test_attention_kernels_match_sdpa(frames: int) -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, frames, 16) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).reshape(2, frames, 64)
    onednn, flash = attention(q, k, v, "onednn"), attention(q, k, v, "flash")
    torch.testing.assert_close(onednn, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(flash, reference, rtol=1e-4, atol=1e-5)
    # "auto" is the kernel timed faster here, to the bit, and stays so within the process.
    chosen = preferred_attention(q)
    assert torch.equal(attention(q, k, v), {"onednn": onednn, "flash": flash}[chosen])
    assert preferred_attention(q) == chosen
    # Elsewhere (half precision, GPU) only torch's kernel applies.
    assert preferred_attention(q.half()) == "flash"


@needs_onednn
def test_the_attention_kernel_timed_here_is_kept_for_the_next_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted server runs the attention kernel its first start timed (the two kernels' sums differ in their
    last bits, and a close call timed again could flip): the choice is written once and read back."""
    choices = tmp_path / "choices.json"
    monkeypatch.setattr(tuning, "choices_file", lambda: choices)
    q = torch.randn(1, 2, 300, 16)
    kernels._timed_choice.cache_clear()
    try:
        first = preferred_attention(q)
        (key,) = (k for k in json.loads(choices.read_text()) if "300 frames" in k)
        assert json.loads(choices.read_text())[key] == first and key.startswith(tuning.machine_key())
        # The next process (nothing cached in it) takes what the file says, without timing again.
        other = "flash" if first == "onednn" else "onednn"
        choices.write_text(json.dumps({key: other}))
        kernels._timed_choice.cache_clear()
        assert preferred_attention(q) == other
    finally:
        kernels._timed_choice.cache_clear()


def test_a_remembered_choice_is_made_once_and_survives_a_damaged_or_unwritable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, allowed = tmp_path / "cache" / "choices.json", ("a", "b", "c", "d", "e")
    assert tuning.remembered("x", allowed, lambda: "a", path) == "a"
    assert tuning.remembered("x", allowed, lambda: "b", path) == "a"  # kept
    assert tuning.remembered("y", allowed, lambda: "b", path) == "b"  # another choice beside it
    path.write_text("{damaged")
    assert tuning.remembered("x", allowed, lambda: "c", path) == "c"  # decided again, and kept again
    assert tuning.remembered("x", allowed, lambda: "d", path) == "c"
    key = f"{tuning.machine_key()}: x"
    path.write_text(json.dumps({key: "flash-v0"}))  # a value this code does not know: decided again
    assert tuning.remembered("x", allowed, lambda: "d", path) == "d"
    (tmp_path / "file").write_text("")
    assert tuning.remembered("x", allowed, lambda: "e", tmp_path / "file" / "choices.json") == "e"  # cannot be kept

    # A read-only home (the containers' root filesystem): the cache's folder cannot even be made.
    def read_only(name: str) -> Path:
        raise PermissionError(30, "Read-only file system", name)

    monkeypatch.setattr(tuning, "build_directory", read_only)
    assert tuning.remembered("x", allowed, lambda: "b") == "b"


def test_pack_linears_replaces_only_fp32_cpu_linears() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8).to(torch.float16), nn.ReLU()))
    expected = 1 if packing_available() else 0
    assert pack_linears(module) == expected
    assert isinstance(module[0], PackedLinear) == packing_available()
    assert type(module[1][0]) is nn.Linear


@pytest.fixture(scope="module")
def speech_features(clip: Callable[[str], np.ndarray]) -> torch.Tensor:
    audio = clip("ljspeech/LJ001-0001")
    mel = log_mel(audio, 80, padding=N_SAMPLES)
    return window(mel, 0, audio.size // 160).unsqueeze(0)


@pytest.mark.slow  # transformers' whole encoder beside ours (~25 s on 2 cores)
def test_encoder_matches_transformers(base: WhisperModel, base_dir: Path, speech_features: torch.Tensor) -> None:
    """The engine's encoder (packed kernels where available, with either attention kernel) and its
    plain twin give transformers' states."""
    from transformers import WhisperForConditionalGeneration

    hf = WhisperForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32).eval()
    plain = AudioEncoder.from_weights(WhisperDims.from_config(hf.config.to_dict()), hf.state_dict())
    torch.manual_seed(2)
    features = torch.cat([speech_features, torch.randn(1, 80, 3000) * 0.3])
    assert base.encoder is not None
    engine = []
    try:
        with torch.inference_mode():
            reference = hf.model.encoder(features).last_hidden_state
            for kernel in ATTENTION_KERNELS:
                base.encoder.attention_kernel = kernel
                engine.append(base.encode(features))
            unpacked = plain(features)
    finally:
        base.encoder.attention_kernel = "auto"
    assert any(isinstance(m, PackedLinear) for m in base.encoder.modules()) == packing_available()
    # fp32 rounding only: the states reach ~10-30 in magnitude.
    for mine in (*engine, unpacked):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=3e-3)
    with pytest.raises(ValueError, match="3000 mel frames"):
        plain(features[..., :2000])


def test_encoder_rows_per_pass_keep_each_row_s_bits(base: WhisperModel, speech_features: torch.Tensor) -> None:
    """Four windows run two at a time (`rows_per_pass`, a CPU's default) or one at a time give the states of
    all four at once, bit for bit, and the heartbeat still runs after every layer of every pass."""
    assert base.encoder is not None
    torch.manual_seed(3)
    features = torch.cat([speech_features, torch.randn(3, 80, 3000) * 0.3])
    beats: list[int] = []
    before = base.encoder.rows_per_pass
    try:
        with torch.inference_mode():
            results = {}
            for rows in (None, 2, 1):
                base.encoder.rows_per_pass = rows
                beats.clear()
                results[rows] = base.encode(features, between_layers=lambda: beats.append(1))
                assert len(beats) == len(base.encoder.layers) * (4 // (rows or 4))
    finally:
        base.encoder.rows_per_pass = before
    assert results[None].shape == (4, base.encoder.n_frames, results[None].shape[-1])
    assert torch.equal(results[2], results[None]) and torch.equal(results[1], results[None])


def _each_isa(ext: object) -> list[str]:
    """The kernel's instruction sets this CPU runs (widest first)."""
    runs = []
    chosen = ext.isa()  # type: ignore[attr-defined]
    try:
        for isa in ("avx512_vnni", "avx2"):
            try:
                ext.use_isa(isa)  # type: ignore[attr-defined]
            except RuntimeError:
                continue
            runs.append(isa)
    finally:
        ext.use_isa(chosen)  # type: ignore[attr-defined]
    return runs


@pytest.mark.skipif(not cpu_runs_kernel(), reason="this CPU has no AVX2 + FMA")
@pytest.mark.parametrize("keys_dtype", [torch.float32, torch.bfloat16])
def test_prefix_attention_gives_a_query_the_same_bits_in_any_call(keys_dtype: torch.dtype) -> None:
    """The decoders' attention: each query over its own first keys, as torch's SDPA with the causal mask
    computes it, and to the bit what the query gets alone, whatever the other queries and rows of the call
    (what a verification pass needs to give each token a one-token step's bits), on every instruction set."""
    ext = kernel_extension()
    assert ext is not None
    generator = torch.Generator().manual_seed(0)
    b, s, h, dh, t = 3, 7, 4, 64, 45
    q = torch.randn(b, s, h * dh, generator=generator)
    keys = torch.randn(b, h, t + 5, dh, generator=generator).to(keys_dtype)[:, :, :t]  # strided, as cache views
    values = torch.randn(b, h, t + 5, dh, generator=generator).to(keys_dtype)[:, :, :t]
    lengths = torch.randint(1, t + 1, (b, s), generator=generator)
    mask = torch.arange(t).view(1, 1, 1, t) < lengths.view(b, 1, s, 1)
    reference = (
        F.scaled_dot_product_attention(
            q.view(b, s, h, dh).transpose(1, 2), keys.float(), values.float(), attn_mask=mask
        )
        .transpose(1, 2)
        .reshape(b, s, h * dh)
    )
    chosen = ext.isa()
    try:
        for isa in _each_isa(ext):
            ext.use_isa(isa)
            out = prefix_attention(q, keys, values, lengths)
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
            for row in range(b):
                for step in range(s):
                    alone = prefix_attention(
                        q[row : row + 1, step : step + 1],
                        keys[row : row + 1],
                        values[row : row + 1],
                        lengths[row : row + 1, step : step + 1],
                    )
                    assert torch.equal(alone[0, 0], out[row, step]), (isa, row, step)
            unmasked = F.scaled_dot_product_attention(q.view(b, s, h, dh).transpose(1, 2), keys.float(), values.float())
            everything = prefix_attention(q, keys, values, None)
            torch.testing.assert_close(everything, unmasked.transpose(1, 2).reshape(b, s, h * dh), rtol=1e-5, atol=1e-5)
    finally:
        ext.use_isa(chosen)
    if keys_dtype == torch.float32:  # torch's SDPA, the fallback, takes one dtype for all three
        torch.testing.assert_close(prefix_attention(q, keys, values, lengths, "sdpa"), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"within 1\.\.T"):
        ext.attention(q, keys, values, torch.zeros(b, s, dtype=torch.long))


@needs_onednn
@pytest.mark.parametrize(
    "shape",
    # the vocabulary-sized projection is the slow case (~17 s on 2 cores): not in the quick tier
    [(512, 512), (1536, 512), (2048, 512), (512, 2048), pytest.param((51865, 512), marks=pytest.mark.slow)],
)
def test_packed_products_give_a_row_the_same_bits_in_any_row_count(shape: tuple[int, int]) -> None:
    """oneDNN sums a lone row of a long product (fc2's 2048 inputs) in another order than the same row among
    others; `PackedLinear` feeds a lone row twice, so every row count from 1 to 60 (a verification pass of four
    rows reaches 52), and the hundreds of a prompt's first pass, give a row the same bits, on one thread and
    on two (Whisper base's product shapes; plain, GELU and residual-add forms)."""
    n, k = shape
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=generator) / k**0.5)
    packed = PackedLinear(linear)
    x = torch.randn(60, k, generator=generator)
    residual = torch.randn(60, n, generator=generator)
    wide = torch.randn(450, k, generator=generator)
    forms: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "plain": lambda a, r: packed(a),
        "gelu": lambda a, r: packed.gelu(a),
        "add": lambda a, r: packed.add(a, r),
    }
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, min(2, threads), threads}):
            torch.set_num_threads(count)
            for name, form in forms.items():
                full = form(x, residual)
                for rows in range(1, 61):
                    assert torch.equal(form(x[:rows], residual[:rows]), full[:rows]), (count, name, rows)
                lone = form(x[:1].view(1, 1, k), residual[:1].view(1, 1, n))
                assert torch.equal(lone, full[:1].view(1, 1, n)), (count, name)
            # a first pass feeds a whole prompt (up to 224 tokens of context, four rows): rows by pairs
            pairs = torch.cat([packed(wide[i : i + 2]) for i in range(0, len(wide), 2)])
            for rows in (128, 233, len(wide)):
                assert torch.equal(packed(wide[:rows]), pairs[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)
