"""The int8 draft kernel (AVX2, or AVX-512 VNNI where the CPU has it) against fp32 arithmetic and torch's
dynamic int8 linear."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from app.engine.decoding.batch import DecoderState
from app.engine.drafting.int8 import dynamic_int8, int8_draft_decoder, int8_twin
from app.model.cpu import cpu_flags
from app.model.decoder import CrossKV, TextDecoder
from app.model.features import N_SAMPLES, log_mel, window
from app.model.int8 import FloatLinear, Int8Linear
from app.model.kernels import PackedLinear, packing_available
from app.model.native import cpu_runs_kernel, kernel_extension, kernel_sources
from app.model.whisper import WhisperModel
from tests.conftest import run_app
from tests.int8_reference import integer_reference

ROOT = Path(__file__).resolve().parents[1]


def _cpu_has_vnni() -> bool:
    return cpu_flags().issuperset(("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"))


needs_kernel = pytest.mark.skipif(not cpu_runs_kernel(), reason="this CPU has no AVX2 + FMA")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().mean() / ref.abs().mean())


@needs_kernel
def test_kernel_builds_and_picks_the_widest_instruction_set() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.fail("no C++ compiler: the setup installs build-essential for the int8 draft kernel")
    ext = kernel_extension()
    assert ext is not None
    assert ext.isa() == ("avx512_vnni" if _cpu_has_vnni() else "avx2")


@needs_kernel
def test_a_build_killed_midway_does_not_block_later_loads(tmp_path: Path) -> None:
    """torch's lock file, left behind by a build whose process was killed, made every later load wait
    for it forever; the next load now removes it and serves the kernel."""
    ext = kernel_extension()
    assert ext is not None and ext.__file__ is not None
    built = Path(ext.__file__).parent
    if built.name != Path(ext.__file__).stem:
        pytest.skip("the kernel came from a portable build, not from torch's extension loader")
    copy = tmp_path / "jit" / built.name
    shutil.copytree(built, copy, symlinks=True)  # the build, up to date: loading it compiles nothing
    (copy / "lock").touch()  # what a killed build leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit"), "SPECWHISPER_KERNEL_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["library"] == str(copy / f"{built.name}.so")
    assert not (copy / "lock").exists()
    assert "did not finish" in run.stderr


@pytest.mark.slow  # builds a wheel
def test_a_built_package_carries_every_kernel_source(tmp_path: Path) -> None:
    """The images build the kernel from `pip install .`: the package must hold every file it includes, and
    the build names (which hash `kernel_sources()`) must change with each of them."""
    sources = kernel_sources()
    included = {name for path in sources for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included and included <= {path.name for path in sources}
    tree = tmp_path / "src"
    shutil.copytree(ROOT / "app", tree / "app", ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(tree)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("specwhisper-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    assert {f"app/model/csrc/{path.name}" for path in sources} <= packaged


PROBE = """
import json, logging, torch
from app.engine.drafting.int8 import int8_twin
from app.model.int8 import Int8Linear
from app.model.native import kernel_extension
logging.basicConfig(level=logging.WARNING)
torch.manual_seed(0)
linear = torch.nn.Linear(512, 1536)
twin = int8_twin(linear)
x = torch.randn(3, 512)
with torch.no_grad():
    error = float((twin(x) - linear(x)).abs().mean() / linear(x).abs().mean())
ext = kernel_extension()
print(json.dumps({"library": getattr(ext, "__file__", None), "kernel": isinstance(twin, Int8Linear), "error": error}))
"""


@needs_kernel
@pytest.mark.slow  # compiles the portable kernel library
def test_a_portable_build_serves_a_machine_without_a_compiler(tmp_path: Path) -> None:
    """`kernels --install` compiles a library that a process with no compiler on its PATH loads and
    runs; without it such a process falls back to torch's int8 linear instead of failing."""
    prebuilt = tmp_path / "prebuilt"
    build = run_app("kernels", "--install", str(prebuilt), cwd=ROOT, timeout=900)
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


@needs_kernel
@pytest.mark.parametrize(("n_in", "n_out", "shape"), [(512, 1536, (1, 1)), (2048, 512, (2, 3)), (64, 51865, (5,))])
def test_kernel_linear_matches_fp32_within_int8_error(n_in: int, n_out: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(n_in, n_out, bias=n_out != 51865)  # the vocabulary projection has no bias
    quantized = int8_twin(linear)
    assert isinstance(quantized, Int8Linear)
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


@needs_kernel
def test_each_instruction_set_computes_the_exact_integer_products() -> None:
    """Every instruction set this CPU runs gives the integer products exactly (1000 outputs: a partial
    last block of 16 rows), and both give the same fp32 result; one it does not run is refused."""
    ext = kernel_extension()
    assert ext is not None
    torch.manual_seed(3)
    linear = nn.Linear(2048, 1000)
    twin = int8_twin(linear)
    assert isinstance(twin, Int8Linear)
    x = torch.nn.functional.gelu(torch.randn(3, 2048) * 2)
    chosen, outputs = ext.isa(), {}
    try:
        for isa in ("avx2", "avx512_vnni"):
            if isa == "avx512_vnni" and not _cpu_has_vnni():
                with pytest.raises(RuntimeError, match="does not run"):
                    ext.use_isa(isa)
                continue
            assert ext.use_isa(isa) == isa
            with torch.no_grad():
                outputs[isa] = twin(x)
        with pytest.raises(RuntimeError, match="unknown instruction set"):
            ext.use_isa("sse2")
    finally:
        ext.use_isa(chosen)
    reference = integer_reference(twin, x)
    for out in outputs.values():
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    if len(outputs) == 2:
        torch.testing.assert_close(outputs["avx2"], outputs["avx512_vnni"], rtol=0, atol=0)


@needs_kernel
@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
def test_packed_linears_quantize_like_plain_ones() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(128, 256)
    x = torch.randn(3, 128)
    with torch.no_grad():
        torch.testing.assert_close(int8_twin(PackedLinear(linear))(x), int8_twin(linear)(x), rtol=0, atol=0)


def test_without_the_kernel_the_draft_uses_torchs_int8(base: WhisperModel) -> None:
    draft = int8_draft_decoder(base.decoder, kernel=False)
    assert not any(isinstance(m, Int8Linear) for m in draft.modules())
    assert all(not isinstance(m, FloatLinear) for m in draft.layers.modules())


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


@needs_kernel
def test_self_draft_runs_on_the_kernel_and_stays_close_to_the_main_decoder(
    base: WhisperModel, speech: tuple[list[int], CrossKV]
) -> None:
    """Fed a real transcript, the kernel's draft predicts what the fp32 decoder predicts about as often as torch's."""
    tokens, cross = speech
    fast = int8_draft_decoder(base.decoder, kernel=True)
    slow = int8_draft_decoder(base.decoder, kernel=False)
    kernel_layers = [m for m in fast.modules() if isinstance(m, Int8Linear)]
    main_linears = [m for m in base.decoder.modules() if isinstance(m, FloatLinear)]
    assert len(kernel_layers) == len(main_linears)  # every product of every layer, and the vocabulary
    main, _ = _teacher_forced(base.decoder, tokens, cross)
    agree_kernel = float((_teacher_forced(fast, tokens, cross)[0] == main).float().mean())
    agree_torch = float((_teacher_forced(slow, tokens, cross)[0] == main).float().mean())
    assert agree_kernel >= 0.85 and agree_kernel >= agree_torch - 0.05


@needs_kernel
@pytest.mark.parametrize("chunks", [[1], [2, 3, 1]], ids=["one-token", "few-token"])
def test_lone_row_steps_in_one_call_match_the_module_path(
    base: WhisperModel, speech: tuple[list[int], CrossKV], chunks: list[int]
) -> None:
    """The fused draft step (batch-1 drafting) computes what the module path computes, fed token by
    token or in feeds of 2-3 tokens (what a row gained in a verification), which it runs column by column."""
    tokens, cross = speech
    draft = int8_draft_decoder(base.decoder, kernel=True)
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


@needs_kernel
def test_one_call_steps_of_a_ragged_batch_match_the_module_path(
    base: WhisperModel, speech: tuple[list[int], CrossKV]
) -> None:
    """Rows at different positions, one of them idle for a step (padding), through the one-call step."""
    tokens, cross = speech
    batch = CrossKV([k.expand(3, -1, -1, -1) for k in cross.keys], [v.expand(3, -1, -1, -1) for v in cross.values])
    draft = int8_draft_decoder(base.decoder, kernel=True)
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
