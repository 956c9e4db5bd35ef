"""Each peer, and each voice-agent framework the tests drive, in its own virtual environment, never the project's;
the peers with the same Whisper weights.

A peer's environment is made once under the peers folder (`<root>/<name>/venv`) and kept while its
recipe is unchanged (a stamp holds the recipe). The weights are the CTranslate2 files the embedded model
ships (`app/store/catalog.py`), assembled once into `<root>/models/<model>/`: the format every
faster-whisper-based peer loads, and the checkpoint SpecWhisper's own weights were converted from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from app.store.ct2 import model_file
from app.tools.comparisons import ct2_source

BUNDLE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt", "vocabulary.json", "preprocessor_config.json")


@dataclass(frozen=True)
class Recipe:
    """How a peer is installed: `first` (each on its own, before anything else), then `no_deps` without their
    declared dependencies, then `packages` with theirs."""

    first: tuple[str, ...] = ()
    no_deps: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    note: str = ""  # what the report says about the installation

    def stamp(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


RECIPES: dict[str, Recipe] = {
    # whisper-live 0.10.0 declares CUDA libraries, PyAudio, OpenVINO, openai-whisper and a torchaudio that
    # wants another torch; its server on the faster_whisper backend imports none of them. It imports torch
    # (to ask for CUDA), faster-whisper 1.2.0 (which it pins), websockets, FastAPI and uvicorn (the REST API);
    # faster-whisper's utilities import requests, and whisper-live pins tokenizers 0.20.3.
    "whisperlive": Recipe(
        first=("torch==2.13.0",),
        no_deps=("whisper-live==0.10.0",),
        packages=(
            "faster-whisper==1.2.0",
            "tokenizers==0.20.3",
            "requests",
            "websockets",
            "fastapi",
            "uvicorn",
            "python-multipart",
        ),
        note="torch 2.13.0 (CPU) first; whisper-live 0.10.0 --no-deps; faster-whisper 1.2.0, tokenizers 0.20.3, "
        "requests, websockets, fastapi, uvicorn, python-multipart (what its faster_whisper server path imports)",
    ),
    "faster-whisper-server": Recipe(
        packages=("faster-whisper-server==0.0.3", "requests"),
        note="faster-whisper-server 0.0.3 with its declared dependencies, and requests (faster-whisper imports it)",
    ),
    # Voice-agent frameworks, clients of this server (tests/test_frameworks.py): each as its users install it.
    "livekit": Recipe(
        packages=("livekit-agents==1.8.9", "livekit-plugins-openai==1.8.9"),
        note="livekit-agents and livekit-plugins-openai 1.8.9 with their dependencies",
    ),
    "pipecat": Recipe(
        packages=("pipecat-ai[openai]==1.14.0",),
        note="pipecat-ai[openai] 1.14.0 with its dependencies (its Silero VAD model ships in the package)",
    ),
    "openai-agents": Recipe(
        packages=("openai-agents[voice]==0.24.0",),
        note="openai-agents[voice] 0.24.0 with its dependencies",
    ),
}


def default_root() -> Path:
    """`$SPECWHISPER_PEERS_DIR`, else the user's cache: kept between runs and clones, outside every repository."""
    if configured := os.environ.get("SPECWHISPER_PEERS_DIR"):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specwhisper" / "peers"


def _pip(python: Path, *args: str) -> None:
    """pip install into that environment; its output is shown only when it fails."""
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_REQUIRE_VIRTUALENV": "0"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def ensure_env(name: str, root: Path | None = None, *, log: bool = True) -> Path:
    """The Python of peer `name`'s environment, made (or remade, when its recipe changed) on first use."""
    recipe = RECIPES[name]
    folder = (root or default_root()) / name
    venv, stamp = folder / "venv", folder / "recipe.stamp"
    python = venv / "bin" / "python"
    if python.exists() and stamp.is_file() and stamp.read_text() == recipe.stamp():
        return python
    if log:
        print(f"setting up {name} in {venv}: {recipe.note}", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for package in recipe.first:
        _pip(python, package)
    if recipe.no_deps:
        _pip(python, "--no-deps", *recipe.no_deps)
    if recipe.packages:
        _pip(python, *recipe.packages)
    stamp.write_text(recipe.stamp())
    return python


def ct2_weights(model: str, root: Path | None = None) -> Path:
    """A CTranslate2 folder of the embedded model `model` (model.bin and its tokenizer files), made once."""
    folder = (root or default_root()) / "models" / model
    if (folder / "model.bin").is_file() and (folder / "complete").is_file():
        return folder
    parts, bundle = ct2_source(model)
    folder.mkdir(parents=True, exist_ok=True)
    model_file(parts, folder / "model.bin", reuse_single=False)
    for name in BUNDLE_FILES:
        if (bundle / name).is_file():
            shutil.copyfile(bundle / name, folder / name)
    (folder / "complete").touch()
    return folder
