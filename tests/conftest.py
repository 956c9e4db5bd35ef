"""Shared fixtures: the bundled models (converted once into the repo's store) and benchmark clips; the test
tiers: `quick` (`pytest -m quick`: every test that starts no server and is not marked slow) and the rest."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from app.api.audio import load_audio
from app.model.cpu import cpu_flags
from app.model.whisper import WhisperModel
from app.settings import default_models_dir
from app.store.catalog import ModelStore
from app.store.loader import load_model
from app.tools.manifest import ManifestClip, benchdata_dir, read_manifest
from app.tools.process import FORBID_START
from tests.server import STARTS_SERVER, server_fixture

ROOT = Path(__file__).resolve().parent.parent

# CPU flags of native half-precision arithmetic. Without them torch falls back to kernels tens of times slower
# than fp32 (a minute or more per window of Whisper base), so tests of half precision on the CPU need them.
_NATIVE_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: starts a real server (set for tests using a server fixture)")
    config.addinivalue_line(
        "markers", "quick: the quick tier, set by conftest: no server start-up, not marked slow (`-m quick`)"
    )


def _starts_server(item: pytest.Item) -> bool:
    """Whether the test uses a fixture that starts a server (`tests.server.server_fixture`, `starts_server`),
    directly or through other fixtures, or is marked `server`."""
    if item.get_closest_marker("server") is not None:
        return True
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(getattr(inspect.unwrap(d.func), STARTS_SERVER, False) for group in defs for d in group)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_server(item):
            item.add_marker(pytest.mark.server)
        elif item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test not known to start a server must not start one (in this process or in a command it runs):
    `ServerProcess` refuses, so that such a test cannot land in the quick tier unnoticed."""
    if item.get_closest_marker("server") is None:
        os.environ[FORBID_START] = item.nodeid
    else:
        os.environ.pop(FORBID_START, None)


def run_app(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m app ARGS...` in a child process, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def cpu_computes_natively(dtype: str) -> bool:
    """Whether this CPU has native `dtype` ("bfloat16" or "float16") arithmetic."""
    return bool(_NATIVE_FLAGS[dtype] & cpu_flags())


def needs_native(dtype: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not cpu_computes_natively(dtype), reason=f"this CPU has no native {dtype} arithmetic ({_NATIVE_FLAGS[dtype]})"
    )


@pytest.fixture(scope="session")
def benchdata() -> Path:
    path = benchdata_dir()
    if not (path / "manifest.jsonl").is_file():
        pytest.fail(f"benchmark data not found at {path} (set SPECWHISPER_BENCHDATA)")
    return path


@pytest.fixture(scope="session")
def manifest(benchdata: Path) -> dict[str, ManifestClip]:
    return {c.id: c for c in read_manifest(benchdata / "manifest.jsonl")}


@pytest.fixture(scope="session")
def clip(manifest: dict[str, ManifestClip]) -> Callable[[str], np.ndarray]:
    cache: dict[str, np.ndarray] = {}

    def get(clip_id: str) -> np.ndarray:
        if clip_id not in cache:
            cache[clip_id] = load_audio(manifest[clip_id].audio)
        return cache[clip_id]

    return get


@pytest.fixture(scope="session")
def store() -> ModelStore:
    return ModelStore(default_models_dir())


@pytest.fixture(scope="session")
def base(store: ModelStore) -> WhisperModel:
    return load_model("whisper-base", store, progress=False)


@pytest.fixture(scope="session")
def base_dir(store: ModelStore, base: WhisperModel) -> Path:
    return Path(base.source)


def copy_side_files(like: Path, into: Path) -> Path:
    """The tokenizer, generation and preprocessor configs of checkpoint `like` into `into`."""
    for name in ("tokenizer.json", "generation_config.json", "preprocessor_config.json"):
        shutil.copyfile(like / name, into / name)
    return into


def save_checkpoint(hf_model, like: Path, into: Path) -> Path:
    """Save a transformers Whisper model with the tokenizer and generation config of `like`."""
    hf_model.save_pretrained(into)
    return copy_side_files(like, into)


# One real server for the streaming and browser tests: live partials every 0.5 s of audio, and always
# speculative (the tests show speculative metrics; tests/test_adaptive.py covers the adaptive mode).
live_server = server_fixture(
    {
        "SPECWHISPER_REALTIME_PARTIAL_INTERVAL_S": "0.5",
        "SPECWHISPER_REALTIME_MAX_EVENT_BYTES": "200000",
        "SPECWHISPER_SPECULATION": "always",
    },
    scope="session",
    name="live-server",
)
