"""The accelerator step-cost script runs on a CPU too (small shape, few steps) and predicts consistently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.tools.gpubench import MAX_CANDIDATES, SHAPES, predict, run_gpubench
from tests.conftest import run_app


def test_predict_matches_hand_computed_speedups() -> None:
    # a = 0.5, k = 1: (1 - 0.25) / 0.5 = 1.5 tokens per pass for one free draft and a verify as costly as a step.
    assert predict(10.0, 0.0, {1: 10.0})["0.5"] == {"draft_length": 1, "speedup": 1.5}
    # Costly drafts favour short drafts; free drafts and flat verification favour the longest.
    assert predict(10.0, 10.0, {1: 10.0, 8: 10.0})["0.9"]["draft_length"] == 1
    assert predict(10.0, 0.0, {1: 10.0, 8: 10.0})["0.9"]["draft_length"] == 8


def test_cpu_smoke_reports_every_step_cost() -> None:
    report = run_gpubench(torch.device("cpu"), torch.float32, SHAPES["tiny"], batch=2, steps=1, context=8)
    assert set(report["verify_ms"]) == {str(n) for n in range(1, MAX_CANDIDATES + 1)}
    assert report["main_step_ms"] > 0 and report["draft_step_ms"] > 0
    assert all(t > 0 for t in report["verify_ms"].values())
    speedups = [v["speedup"] for v in report["predicted_decode_speedup"].values()]
    assert speedups == sorted(speedups)  # higher acceptance never predicts less


def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    args = ["gpubench", "--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--steps", "1", "--json", str(out)]
    done = run_app(*args, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["shape"]["main_layers"] == SHAPES["tiny"].main_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_large_v3_on_cuda_fp16() -> None:
    report = run_gpubench(torch.device("cuda"), torch.float16, SHAPES["large-v3"], steps=3)
    assert report["main_step_ms"] > report["draft_step_ms"]
