"""Shared fixtures: the bundled models (converted once into the repo's store) and benchmark clips."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from app.api.audio import load_audio
from app.model.whisper import WhisperModel
from app.settings import default_models_dir
from app.store.catalog import ModelStore
from app.store.loader import load_model
from tests.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent

# CPU flags of native half-precision arithmetic. Without them torch falls back to kernels tens of times slower
# than fp32 (a minute or more per window of Whisper base), so tests of half precision on the CPU need them.
_NATIVE_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}


def cpu_computes_natively(dtype: str) -> bool:
    """Whether this CPU has native `dtype` ("bfloat16" or "float16") arithmetic (Linux /proc/cpuinfo)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and bool(_NATIVE_FLAGS[dtype] & set(cpuinfo.read_text().split()))


def needs_native(dtype: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not cpu_computes_natively(dtype), reason=f"this CPU has no native {dtype} arithmetic ({_NATIVE_FLAGS[dtype]})"
    )


def benchdata_dir() -> Path:
    configured = os.environ.get("SPECWHISPER_BENCHDATA")
    return Path(configured) if configured else ROOT.parent / "shared" / "benchdata"


@pytest.fixture(scope="session")
def benchdata() -> Path:
    path = benchdata_dir()
    if not (path / "manifest.jsonl").is_file():
        pytest.fail(f"benchmark data not found at {path} (set SPECWHISPER_BENCHDATA)")
    return path


@pytest.fixture(scope="session")
def manifest(benchdata: Path) -> dict[str, dict]:
    entries = [json.loads(line) for line in (benchdata / "manifest.jsonl").read_text().splitlines() if line]
    return {e["id"]: e for e in entries}


@pytest.fixture(scope="session")
def clip(benchdata: Path, manifest: dict[str, dict]) -> Callable[[str], np.ndarray]:
    cache: dict[str, np.ndarray] = {}

    def get(clip_id: str) -> np.ndarray:
        if clip_id not in cache:
            cache[clip_id] = load_audio(benchdata / manifest[clip_id]["audio"])
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


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server for the streaming and browser tests: live partials every 0.5 s of audio, and always
    speculative (the tests show speculative metrics; tests/test_adaptive.py covers the adaptive mode)."""
    log = tmp_path_factory.mktemp("live-server") / "server.log"
    env = {
        "SPECWHISPER_REALTIME_PARTIAL_INTERVAL_S": "0.5",
        "SPECWHISPER_REALTIME_MAX_EVENT_BYTES": "200000",
        "SPECWHISPER_SPECULATION": "always",
    }
    srv = ServerProcess(env, log=log).start()
    yield srv
    srv.stop()
