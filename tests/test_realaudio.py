"""The real-world audio benchmark (app/tools/realaudio.py): its hard-audio set, and the command end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.tools.manifest import ManifestClip
from app.tools.realaudio import SR, build_conditions, long_recording
from tests.conftest import run_app


def test_the_hard_audio_set(manifest: dict[str, ManifestClip]) -> None:
    english = [c for c in manifest.values() if c.language == "en" and c.subset == "short"][:3]
    conditions = {c.name: c for c in build_conditions(english)}
    non_speech = [name for name, c in conditions.items() if c.reference is None]
    assert non_speech == ["silence", "room hiss", "loud noise", "music"]
    assert all(conditions[name].minutes == pytest.approx(1.0) for name in non_speech)
    assert not np.any(conditions["silence"].audio)
    speech_seconds = sum(c.duration_s for c in english)
    assert conditions["long pauses"].audio.size / SR > speech_seconds + 2 * 8  # pauses of 8 to 20 s
    clean = conditions["noise 20 dB SNR"].audio
    noisier = conditions["noise 5 dB SNR"].audio
    assert clean.size == noisier.size and np.std(noisier) > np.std(clean)
    telephone = conditions["telephone (G.711)"].audio
    spectrum = np.abs(np.fft.rfft(telephone))
    assert spectrum[int(4100 * telephone.size / SR) :].max() < 0.01 * spectrum.max()  # nothing above 4 kHz
    audio, text = long_recording(english, 0.5)
    assert audio.size >= 30 * SR and text.startswith(english[0].text)


def _bench_audio(benchdata: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    """`bench-audio` run as a command with `args`; its JSON report."""
    out = tmp_path / "audio.json"
    done = run_app(
        "bench-audio", "--manifest", str(benchdata / "manifest.jsonl"), *args, "--json", str(out), timeout=900
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.mark.server
@pytest.mark.slow
def test_bench_audio_long_file(benchdata: Path, tmp_path: Path) -> None:
    report = _bench_audio(benchdata, tmp_path, "--part", "long", "--long-minutes", "0.5")["long"]
    systems = ("ours sequential", "ours chunked (batched)", "faster-whisper sequential", "faster-whisper batched")
    for name in systems:
        assert report[name]["seconds"] > 0 and report[name]["wer"] < 0.2, (name, report[name])


@pytest.mark.server
@pytest.mark.slow
def test_bench_audio_noise_reduction(benchdata: Path, tmp_path: Path) -> None:
    """The measurement behind `noise_reduction` being a no-op: both suppressors really run (they change what the
    model hears), every condition is reported for each, and on noise alone turn detection starts nothing."""
    report = _bench_audio(benchdata, tmp_path, "--part", "noise-reduction", "--clips", "2")
    suppressors = {"none", "rnnoise", "spectral gating"}
    assert set(report) == {"wer", "false starts per minute", "turns found of 2"}
    assert len(report["wer"]) == 7 and all(set(row) == suppressors for part in report.values() for row in part.values())
    assert report["wer"]["clean"]["none"] < 0.2
    assert any(row["rnnoise"] != row["none"] for row in report["wer"].values())
    assert any(row["spectral gating"] != row["none"] for row in report["wer"].values())
    assert all(row["none"] == 0 for row in report["false starts per minute"].values())
    assert all(row["none"] >= 2 for name, row in report["turns found of 2"].items() if name.startswith("pink"))
