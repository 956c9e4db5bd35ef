"""The int8 draft kernel (AVX-512 VNNI) against fp32 arithmetic and torch's dynamic int8 linear."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from app.engine.batch import DecoderState
from app.engine.decoder import CrossKV, TextDecoder
from app.engine.features import N_SAMPLES, log_mel, window
from app.engine.int8 import VnniLinear, dynamic_int8, int8_twin, vnni_extension
from app.engine.kernels import PackedLinear, packing_available
from app.engine.model import WhisperModel

ROOT = Path(__file__).resolve().parents[1]


def _cpu_has_vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_vnni" in flags and "avx512bw" in flags


needs_vnni = pytest.mark.skipif(not _cpu_has_vnni(), reason="this CPU has no AVX-512 VNNI")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().mean() / ref.abs().mean())


@needs_vnni
def test_kernel_builds_on_a_vnni_cpu_with_a_compiler() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.fail("no C++ compiler: the setup installs build-essential for the int8 draft kernel")
    assert vnni_extension() is not None


PROBE = """
import json, logging, torch
from app.engine.int8 import VnniLinear, int8_twin, vnni_extension
logging.basicConfig(level=logging.WARNING)
torch.manual_seed(0)
linear = torch.nn.Linear(512, 1536)
twin = int8_twin(linear)
x = torch.randn(3, 512)
with torch.no_grad():
    error = float((twin(x) - linear(x)).abs().mean() / linear(x).abs().mean())
ext = vnni_extension()
print(json.dumps({"library": getattr(ext, "__file__", None), "kernel": isinstance(twin, VnniLinear), "error": error}))
"""


@needs_vnni
def test_a_portable_build_serves_a_machine_without_a_compiler(tmp_path: Path) -> None:
    """`kernels --install` compiles a library that a process with no compiler on its PATH loads and
    runs; without it such a process falls back to torch's int8 linear instead of failing."""
    prebuilt = tmp_path / "prebuilt"
    build = subprocess.run(
        [sys.executable, "-m", "app", "kernels", "--install", str(prebuilt)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr
    (tmp_path / "bin").mkdir()

    def probe(kernel_dir: Path) -> dict[str, object]:
        env = {
            "PATH": str(tmp_path / "bin"),  # no c++, no ninja
            "HOME": str(tmp_path),
            "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit"),  # no earlier native build either
            "SPECWHISPER_KERNEL_DIR": str(kernel_dir),
            "PYTHONPATH": str(ROOT),
        }
        run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return dict(json.loads(run.stdout.strip().splitlines()[-1]))

    served = probe(prebuilt)
    assert served["kernel"] is True
    assert Path(str(served["library"])).parent == prebuilt
    assert float(str(served["error"])) < 0.02
    bare = probe(tmp_path / "empty")
    assert bare["kernel"] is False and bare["library"] is None
    assert float(str(bare["error"])) < 0.05
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / Path(str(served["library"])).name).write_bytes(b"not a library")
    assert probe(damaged)["kernel"] is False  # a warning, torch's int8, no crash


@needs_vnni
@pytest.mark.parametrize(("n_in", "n_out", "shape"), [(512, 1536, (1, 1)), (2048, 512, (2, 3)), (64, 51865, (5,))])
def test_vnni_linear_matches_fp32_within_int8_error(n_in: int, n_out: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(n_in, n_out, bias=n_out != 51865)  # the vocabulary projection has no bias
    quantized = int8_twin(linear)
    assert isinstance(quantized, VnniLinear)
    x = torch.nn.functional.gelu(torch.randn(*shape, n_in) * 2)  # skewed, like the inputs of fc2
    with torch.no_grad():
        ref = linear(x)
        out = quantized(x)
        assert out.shape == ref.shape
        assert _relative_error(out, ref) < 0.02
        # Rows are quantized one by one: a row's result does not depend on its neighbours.
        flat = x.reshape(-1, n_in)
        torch.testing.assert_close(quantized(flat[:1]), out.reshape(-1, n_out)[:1], rtol=0, atol=0)
        # At least as close to fp32 as torch's int8 linear (per-row weight scales against one per tensor).
        assert _relative_error(out, ref) <= 1.1 * _relative_error(dynamic_int8(linear)(x), ref)
        assert quantized(torch.empty(0, n_in)).shape == (0, n_out)


@needs_vnni
@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
def test_packed_linears_quantize_like_plain_ones() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 256)
    x = torch.randn(3, 128)
    with torch.no_grad():
        torch.testing.assert_close(int8_twin(PackedLinear(linear))(x), int8_twin(linear)(x), rtol=0, atol=0)


def test_without_the_kernel_the_draft_uses_torchs_int8(base: WhisperModel) -> None:
    draft = base.decoder.quantized_copy(kernel=False)
    assert not any(isinstance(m, VnniLinear) for m in draft.modules())
    assert all(not isinstance(m, nn.Linear | PackedLinear) for m in draft.layers.modules())


TEXT = " Printing, in the only sense with which we are at present concerned, differs from most if not from all the arts"


@pytest.fixture(scope="module")
def speech(base: WhisperModel, clip) -> tuple[list[int], CrossKV]:  # type: ignore[no-untyped-def]
    """A real clip's cross-attention keys/values and its transcript's tokens (prompt first)."""
    audio = clip("ljspeech/LJ001-0001")
    features = window(log_mel(np.pad(audio, (0, max(0, N_SAMPLES - audio.size))), base.n_mels), 0)
    with torch.inference_mode():
        cross = base.decoder.cross_kv(base.encode(features.unsqueeze(0)))
    return base.tokenizer.prompt("en", "transcribe") + base.tokenizer.encode(TEXT), cross


def _teacher_forced(
    decoder: TextDecoder, tokens: list[int], cross: CrossKV, chunks: Sequence[int] | None = None
) -> tuple[Tensor, DecoderState]:
    """The decoder's greedy pick after each prefix of `tokens` (from the 4th on): fed at once, or
    the first 4 and then the rest in feeds whose sizes cycle through `chunks`."""
    with torch.inference_mode():
        state = DecoderState.start(decoder, cross, 1)
        if chunks is None:
            return decoder.logits(state.feed([tokens])[0][0, 3:]).argmax(-1), state
        hidden = [state.feed([tokens[:4]])[0][0, 3:]]
        at = 4
        for size in itertools.cycle(chunks):
            if at >= len(tokens):
                break
            hidden.append(state.feed([tokens[at : at + size]])[0][0])
            at += size
        return decoder.logits(torch.cat(hidden)).argmax(-1), state


def _assert_close_entries(written: Tensor, reference: Tensor) -> None:
    """Cache entries of the one-call step and of the module path agree to int8 rounding."""
    assert float((written - reference).abs().mean()) < 0.05 * float(reference.abs().mean())


@needs_vnni
def test_self_draft_runs_on_the_kernel_and_stays_close_to_the_main_decoder(
    base: WhisperModel, speech: tuple[list[int], CrossKV]
) -> None:
    """Fed a real transcript, the kernel's draft predicts what the fp32 decoder predicts about as often as torch's."""
    tokens, cross = speech
    fast = base.decoder.quantized_copy(kernel=True)
    slow = base.decoder.quantized_copy(kernel=False)
    kernel_layers = [m for m in fast.modules() if isinstance(m, VnniLinear)]
    main_linears = [m for m in base.decoder.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert len(kernel_layers) == len(main_linears)  # every product of every layer, and the vocabulary
    main, _ = _teacher_forced(base.decoder, tokens, cross)
    agree_kernel = float((_teacher_forced(fast, tokens, cross)[0] == main).float().mean())
    agree_torch = float((_teacher_forced(slow, tokens, cross)[0] == main).float().mean())
    assert agree_kernel >= 0.85 and agree_kernel >= agree_torch - 0.05


@needs_vnni
@pytest.mark.parametrize("chunks", [[1], [2, 3, 1]], ids=["one-token", "few-token"])
def test_lone_row_steps_in_one_call_match_the_module_path(
    base: WhisperModel, speech: tuple[list[int], CrossKV], chunks: list[int]
) -> None:
    """The fused draft step (batch-1 drafting) computes what the module path computes, fed token by
    token or in feeds of 2-3 tokens (what a row gained in a verification), which it runs column by column."""
    tokens, cross = speech
    draft = base.decoder.quantized_copy(kernel=True)
    assert draft.token_step is not None
    fused, fused_state = _teacher_forced(draft, tokens, cross, chunks)
    stack, draft.token_step = draft.token_step, None
    module, module_state = _teacher_forced(draft, tokens, cross, chunks)
    draft.token_step = stack
    n = len(tokens)
    assert fused.shape == (n - 3,) and fused_state.fed == module_state.fed == [n]
    # int8 rounding of activations may flip between the two (their fp32 sums differ in the last bits),
    # so compare what the draft proposes, not bits.
    assert float((fused == module).float().mean()) >= 0.9
    for layer in range(len(draft.layers)):
        for mine, theirs in (
            (fused_state.cache.keys, module_state.cache.keys),
            (fused_state.cache.values, module_state.cache.values),
        ):
            _assert_close_entries(mine[layer][0, :, :n], theirs[layer][0, :, :n])
            assert not mine[layer][0, :, n:].any()  # nothing past the fed positions


@needs_vnni
def test_one_call_steps_of_a_ragged_batch_match_the_module_path(
    base: WhisperModel, speech: tuple[list[int], CrossKV]
) -> None:
    """Rows at different positions, one of them idle for a step (padding), through the one-call step."""
    tokens, cross = speech
    batch = CrossKV([k.expand(3, -1, -1, -1) for k in cross.keys], [v.expand(3, -1, -1, -1) for v in cross.values])
    draft = base.decoder.quantized_copy(kernel=True)
    starts = [4, 9, 6]
    results = {}
    for name, step in (("fused", draft.token_step), ("module", None)):
        draft.token_step = step
        with torch.inference_mode():
            state = DecoderState.start(draft, batch, 3, capacity=64)
            state.feed([tokens[:n] for n in starts])
            picks = []
            for i in range(12):
                feeds = [[tokens[n + i]] if not (r == 2 and i == 3) else [] for r, n in enumerate(starts)]
                hidden, _ = state.feed(feeds)
                picks.append(draft.logits(hidden[:, 0]).argmax(-1))
        results[name] = (torch.stack(picks), state)
    fused, fused_state = results["fused"]
    module, module_state = results["module"]
    assert fused_state.fed == module_state.fed == [16, 21, 17]
    real = torch.ones_like(fused, dtype=torch.bool)
    real[3, 2] = False  # the idle row's output is padding
    assert float((fused == module)[real].float().mean()) >= 0.9
    for layer in range(len(draft.layers)):
        for r, n in enumerate(fused_state.fed):
            _assert_close_entries(fused_state.cache.keys[layer][r, :, :n], module_state.cache.keys[layer][r, :, :n])
