"""An int8 main model (`dtype=int8`): every linear layer int8 on this project's kernel or on oneDNN's int8 matmul,
each row the same bits on every path; it loads, transcribes and says where it cannot run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

from app.api.audio import load_audio
from app.api.types import DecodingOptions
from app.engine.build import build_engine
from app.engine.drafting.assistants import self_draft
from app.engine.engine import Engine
from app.model.int8 import FloatLinear, Int8Linear, int_mm_runs
from app.model.native import cpu_runs_kernel, kernel_extension
from app.model.whisper import WhisperModel
from app.settings import Settings
from app.store import loader
from app.store.catalog import ModelStore
from app.store.loader import PrecisionError, is_settings_error, load_model
from app.tools.manifest import ManifestClip
from tests.clients import check_text, encode
from tests.int8_reference import integer_reference
from tests.server import openai_client, running_server

needs_kernel = pytest.mark.skipif(not cpu_runs_kernel(), reason="this CPU has no AVX2 + FMA")


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "n_in", "n_out"),
    [(1, 512, 1000), (15, 512, 1536), (16, 2048, 512), (53, 512, 2048), (301, 2048, 1000), (1500, 512, 520)],
)
def test_every_path_gives_a_row_the_same_bits(rows: int, n_in: int, n_out: int) -> None:
    """A row's output is the same bits whether the kernel runs it alone, among a few rows (one row at a time
    through the weights), among many (tiles of rows), or oneDNN's int8 matmul takes the integer products, on
    every instruction set the CPU runs: what keeps an int8 decoder batch-invariant and a window's encoder states
    independent of its neighbours."""
    ext = kernel_extension()
    torch.manual_seed(rows)
    linear = nn.Linear(n_in, n_out)
    x = torch.nn.functional.gelu(torch.randn(rows, n_in) * 2)  # skewed, as the inputs of fc2
    x[:, :3] -= 4  # and some negative
    kernel = Int8Linear(linear, ext)
    onednn = Int8Linear(linear, ext, many_rows=True) if int_mm_runs() else None
    if onednn is not None:
        assert onednn.packed is None and onednn.weight_int8 is not None  # one layout, not two
    chosen, outputs = ext.isa(), []
    try:
        for isa in ("avx512_vnni", "avx2") if chosen == "avx512_vnni" else ("avx2",):
            ext.use_isa(isa)
            with torch.no_grad():
                outputs += [kernel(x), torch.cat([kernel(x[i : i + 1]) for i in range(rows)])]
                if onednn is not None:
                    outputs += [onednn(x), onednn(x.view(1, rows, n_in)).view(rows, n_out)]
    finally:
        ext.use_isa(chosen)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    torch.testing.assert_close(outputs[0], integer_reference(kernel, x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert float((outputs[0] - linear(x)).abs().mean() / linear(x).abs().mean()) < 0.02


@needs_kernel
def test_an_int8_model_holds_int8_products_and_a_quarter_of_the_bytes(store: ModelStore, base: WhisperModel) -> None:
    main = load_model("whisper-base", store, int8=True, progress=False)
    assert main.encoder is not None and main.dtype == torch.float32
    linears = [m for m in main.decoder.modules() if isinstance(m, FloatLinear)]
    assert not linears and not any(isinstance(m, FloatLinear) for m in main.encoder.modules())
    encoder = [m for m in main.encoder.modules() if isinstance(m, Int8Linear)]
    decoder = {n: m for n, m in main.decoder.named_modules() if isinstance(m, Int8Linear)}
    assert len(encoder) == 4 * len(main.encoder.layers) and len(decoder) == 7 * len(main.decoder.layers) + 1
    # the encoder's products and the decoder's audio keys/values have 1500 rows a window: oneDNN's matmul
    many = int_mm_runs()
    assert all((m.weight_int8 is not None) == many for m in encoder)
    assert all((m.weight_int8 is not None) == (many and n.endswith("cross_kv")) for n, m in decoder.items())

    def product_bytes(model: WhisperModel) -> int:
        modules = [*model.decoder.modules(), *(model.encoder.modules() if model.encoder else [])]
        int8 = sum(t.numel() * t.element_size() for m in modules if isinstance(m, Int8Linear) for t in m.buffers())
        fp32 = sum(4 * m.in_features * m.out_features for m in modules if isinstance(m, FloatLinear))
        return int8 + fp32

    # the fp32 model's packed projection keeps its own copy of the embedding table: so does int8's, in int8
    assert product_bytes(main) < 0.3 * product_bytes(base)
    engine = Engine(main, self_draft(main))
    assert engine.describe()["dtype"] == engine.describe()["encoder_dtype"] == "int8"
    assert engine.describe()["int8_kernel"] == kernel_extension().isa()
    assert engine.describe()["decoder_weights"] == "int8"


def test_int8_where_it_cannot_run_stops_with_the_reason(store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never another precision than the one asked for: int8 on a GPU, or where the kernel does not run, is a
    settings error (the server stops at start-up with the message)."""
    with pytest.raises(PrecisionError, match="int8 runs on CPUs") as on_gpu:
        build_engine(Settings(device="cuda", dtype="int8"), progress=False)
    assert is_settings_error(on_gpu.value)
    with pytest.raises(PrecisionError, match="computes in float32"):
        load_model("whisper-base", store, dtype=torch.bfloat16, int8=True, progress=False)
    monkeypatch.setattr(loader, "kernel_extension", lambda: None)  # a CPU without AVX2, or no build and no compiler
    with pytest.raises(PrecisionError, match="needs this project's int8 kernel"):
        load_model("whisper-base", store, int8=True, progress=False)


@needs_kernel
def test_an_int8_encoder_feeds_fp32_decoders(store: ModelStore, clip: Callable[[str], np.ndarray]) -> None:
    """`encoder_dtype=int8` alone: the encoder's products in int8, the decoders in fp32; the transcript holds."""
    engine = build_engine(Settings(encoder_dtype="int8"), progress=False)
    assert engine.describe()["encoder_dtype"] == "int8" and engine.describe()["dtype"] == "float32"
    text = engine.transcribe([clip("whisper/jfk")], [DecodingOptions(language="en")])[0].text
    assert "ask not what your country can do for you" in text.lower()


@needs_kernel
@pytest.mark.server
def test_a_server_with_dtype_int8_says_so_and_answers(manifest: dict[str, ManifestClip], tmp_path: Path) -> None:
    with running_server({"SPECWHISPER_DTYPE": "int8"}, tmp_path / "server.log", clean_log=True) as srv:
        engine = httpx.get(f"{srv.url}/health/ready", timeout=10).json()["engine"]
        assert engine["dtype"] == engine["encoder_dtype"] == "int8", engine
        assert engine["int8_kernel"] in ("avx512_vnni", "avx2") and engine["batch_invariant"] is True, engine
        clip = manifest["whisper/jfk"]
        name, data = encode(load_audio(clip.audio), "flac")
        answer = openai_client(srv).audio.transcriptions.create(model="whisper-1", file=(name, data), language="en")
        check_text(manifest, clip.id, answer.text)


@pytest.mark.server
def test_a_server_asked_for_int8_on_a_gpu_stops_with_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server({"SPECWHISPER_DEVICE": "cuda", "SPECWHISPER_DTYPE": "int8"}, log, ready=False) as srv:
        assert srv.proc is not None
        code = srv.proc.wait(timeout=180)
    text = log.read_text()
    assert code == 1, text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: the server stopped:") and "dtype int8 runs on CPUs" in last, last
