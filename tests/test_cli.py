"""The command-line contract other tools rely on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=600)


def test_transcribe_json_speculative_and_plain_agree(benchdata: Path) -> None:
    files = [str(benchdata / "audio/whisper/jfk.wav"), str(benchdata / "audio/fleurs/fleurs-es-002.wav")]
    spec = _run("transcribe", *files, "--format", "json")
    plain = _run("transcribe", *files, "--format", "json", "--no-assistant")
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


def test_text_format_and_errors(benchdata: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    out = _run("transcribe", str(bad), str(benchdata / "audio/whisper/jfk.wav"), "--language", "en")
    assert out.returncode == 1
    assert "bad.wav" in out.stderr and "error" in out.stderr
    assert out.stdout.strip().startswith("And so my fellow Americans")


def test_models_list() -> None:
    out = _run("models", "list")
    assert out.returncode == 0
    assert "whisper-base" in out.stdout and "whisper-tiny.en" in out.stdout
