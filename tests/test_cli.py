"""The command-line contract other tools rely on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_native, run_app

pytestmark = pytest.mark.slow  # not in the quick tier: each test runs `python -m app` commands that load models

METRIC_FIELDS = {
    "audio_seconds",
    "encode_ms",
    "decode_ms",
    "total_ms",
    "tokens",
    "draft_proposed",
    "draft_accepted",
    "acceptance_rate",
    "main_passes",
    "real_time_factor",
}


def test_transcribe_json_speculative_and_plain_agree(benchdata: Path) -> None:
    files = [str(benchdata / "audio/whisper/jfk.wav"), str(benchdata / "audio/fleurs/fleurs-es-002.wav")]
    spec = run_app("transcribe", *files, "--format", "json")
    plain = run_app("transcribe", *files, "--format", "json", "--no-assistant")
    assert spec.returncode == 0, spec.stderr
    assert plain.returncode == 0, plain.stderr
    spec_rows = [json.loads(line) for line in spec.stdout.splitlines()]
    plain_rows = [json.loads(line) for line in plain.stdout.splitlines()]
    assert len(spec_rows) == len(plain_rows) == 2
    for s, p in zip(spec_rows, plain_rows, strict=True):
        assert s["metrics"].keys() >= METRIC_FIELDS
        assert s["tokens"] == p["tokens"] and s["text"] == p["text"]
        assert s["metrics"]["draft_proposed"] > 0 and p["metrics"]["draft_proposed"] == 0
        assert s["metrics"]["tokens"] == len(s["tokens"])
        assert all(t < 50257 for t in s["tokens"])  # prompt and end-of-text excluded
    assert "ask not what your country can do for you" in spec_rows[0]["text"].lower()
    assert spec_rows[1]["language"] == "es"


@needs_native("bfloat16")
def test_beam_size_flag(benchdata: Path) -> None:
    """--beam-size 5 decodes by beam search, speculative or not, with the same tokens; a bad width is refused."""
    jfk = str(benchdata / "audio/whisper/jfk.wav")
    spec = run_app("transcribe", jfk, "--language", "en", "--format", "json", "--beam-size", "5")
    plain = run_app("transcribe", jfk, "--language", "en", "--format", "json", "--beam-size", "5", "--no-assistant")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["metrics"]["decoding"] == p["metrics"]["decoding"] == "beam" and s["metrics"]["beam_size"] == 5
    assert s["tokens"] == p["tokens"] and "ask not what your country" in s["text"].lower()
    bad = run_app("transcribe", jfk, "--beam-size", "0")
    assert bad.returncode != 0 and "beam_size" in bad.stderr


def test_half_precision_flags(benchdata: Path) -> None:
    """--dtype bfloat16 (the whole model, with the default int8 self-draft) and --encoder-dtype bfloat16 (the
    encoder alone) both transcribe speculatively; a bad choice is refused by name."""
    jfk = str(benchdata / "audio/whisper/jfk.wav")
    for flags in (["--dtype", "bfloat16"], ["--encoder-dtype", "bfloat16"]):
        out = run_app("transcribe", jfk, "--language", "en", "--format", "json", *flags)
        assert out.returncode == 0, out.stderr
        row = json.loads(out.stdout)
        assert "ask not what your country can do for you" in row["text"].lower(), flags
        assert row["metrics"]["draft_accepted"] > 0, flags
    bad = run_app("transcribe", jfk, "--encoder-dtype", "int4")
    assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr


def test_text_format_and_errors(benchdata: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    out = run_app("transcribe", str(bad), str(benchdata / "audio/whisper/jfk.wav"), "--language", "en")
    assert out.returncode == 1
    assert "bad.wav" in out.stderr and "error" in out.stderr
    assert out.stdout.strip().startswith("And so my fellow Americans")


def test_models_list() -> None:
    out = run_app("models", "list")
    assert out.returncode == 0
    assert "whisper-base" in out.stdout and "whisper-tiny.en" in out.stdout


def test_subtitle_and_verbose_formats(benchdata: Path) -> None:
    jfk = str(benchdata / "audio/whisper/jfk.wav")
    srt = run_app("transcribe", jfk, "--language", "en", "--format", "srt")
    assert srt.returncode == 0, srt.stderr
    assert srt.stdout.startswith("1\n00:00:00,000 --> 00:00:0")
    vtt = run_app("transcribe", jfk, "--language", "en", "--format", "vtt")
    assert vtt.stdout.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = run_app("transcribe", jfk, "--format", "verbose_json", "--timestamps", "word")
    body = json.loads(verbose.stdout)
    assert body["task"] == "transcribe" and body["language"] == "english" and body["duration"] == 11.0
    assert (
        len(body["segments"]) >= 2 and {"start", "end", "text", "tokens", "avg_logprob"} <= body["segments"][0].keys()
    )
    assert body["words"][0]["word"] == "And" and body["words"][-1]["end"] > 9.0


def test_batch_flag_gives_the_same_tokens(benchdata: Path) -> None:
    files = [str(benchdata / f"audio/fleurs/fleurs-{lang}-002.wav") for lang in ("de", "es", "pt")]
    one_by_one = run_app("transcribe", *files, "--format", "json")
    batched = run_app("transcribe", *files, "--format", "json", "--batch")
    assert batched.returncode == 0, batched.stderr
    rows = [json.loads(line) for line in batched.stdout.splitlines()]
    assert [r["tokens"] for r in rows] == [json.loads(line)["tokens"] for line in one_by_one.stdout.splitlines()]
    assert [r["metrics"]["batch_size"] for r in rows] == [3, 3, 3]
    assert [r["language"] for r in rows] == ["de", "es", "pt"]


CORE_ONLY = r"""
import importlib, importlib.metadata as md, pkgutil, re, sys, tomllib
from packaging.requirements import Requirement

def name(dist): return re.sub(r"[-_.]+", "-", dist).lower()

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
core, todo = {name(project["name"])}, [Requirement(r) for r in project["dependencies"]]
while todo:  # the core dependencies and everything they require
    req = todo.pop()
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if name(req.name) in core:
        continue
    core.add(name(req.name))
    try:
        todo += [Requirement(r) for r in md.requires(req.name) or []]
    except md.PackageNotFoundError:
        pass
extras = {module for module, dists in md.packages_distributions().items() if not {name(d) for d in dists} & core}

class OnlyCore:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in extras:
            raise ModuleNotFoundError(f"{fullname} is not installed by `pip install .`", name=fullname)

sys.meta_path.insert(0, OnlyCore())
import app
from app.cli.main import build_parser
build_parser().parse_args(["serve"])
failed = []
for module in pkgutil.walk_packages(app.__path__, "app."):
    if module.name != "app.__main__":
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            if module.name.startswith("app.server.cluster") and "specwhisper[ray]" in str(exc):
                continue  # the `ray` extra's package says which extra it needs
            failed.append(f"{module.name}: {exc}")
print("\n".join(failed))
"""


def test_a_plain_install_runs_the_cli_and_every_module() -> None:
    """The images run `pip install .`: with only the core dependencies (and what they pull in) importable,
    the CLI parses and every module imports; extras stay behind function-level imports, except the Ray
    package, which names the extra it needs."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", CORE_ONLY], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
