"""The benchmark command runs both modes side by side and reports the agreed keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.model.native import cpu_runs_kernel, kernel_isa
from app.tools.bench import select_clips
from app.tools.manifest import read_manifest
from app.tools.precisionbench import SPOKEN_CONDITIONS
from tests.conftest import run_app


def _bench(benchdata: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    """`python -m app bench` on the benchdata manifest with `args`: its JSON report (the command must succeed)."""
    out_json = tmp_path / "bench.json"
    out = run_app("bench", "--manifest", str(benchdata / "manifest.jsonl"), *args, "--json", str(out_json), timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out_json.read_text())  # type: ignore[no-any-return]


@pytest.mark.slow  # the whole bench, with reference decoders and a child process per mode
def test_bench_reports_identical_tokens_and_ratios(benchdata: Path, tmp_path: Path) -> None:
    report = _bench(benchdata, tmp_path, "--languages", "en,es", "--limit", "3", "--batch", "2")
    for key in (
        "clips",
        "identical_fraction",
        "decode_speedup",
        "e2e_speedup",
        "acceptance_rate",
        "wer_main",
        "wer_spec",
        "languages",
        "batches",
        "per_clip",
        "peak_rss_mb",
    ):
        assert key in report
    assert report["clips"] == 3 and report["identical_fraction"] == 1.0
    assert report["wer_main"] == report["wer_spec"] < 0.5  # same tokens, same text, real transcripts
    assert 0.0 < report["acceptance_rate"] <= 1.0 and report["decode_speedup"] > 0
    assert report["batches"]["2"]["identical"] is True
    # Both modes share the encoder: speculation cannot take a request below that share.
    assert report["e2e_ceiling"] > 1 and report["batches"]["2"]["throughput_ceiling"] > 1
    assert report["batches"]["2"]["decode_ratio"] > 0
    assert set(report["languages"]) <= {"en", "es"}
    # What it ran on, so that figures from different machines can be told apart.
    machine = report["machine"]
    assert machine["model"] == "whisper-base" and machine["assistant"].startswith("self-draft")
    assert machine["threads"] >= 1 and machine["cpu"] and machine["dtype"] == "float32"
    assert machine["encoder_attention"] in ("onednn", "flash")
    assert machine["decoder_attention"] == ("invariant" if cpu_runs_kernel() else "sdpa")
    assert isinstance(machine["batch_invariant"], bool)
    if cpu_runs_kernel():  # the bench checked, as a worker's warm-up does
        assert machine["batch_invariant"] is True
    assert machine["int8_kernel"] == (kernel_isa() if cpu_runs_kernel() else None)
    assert machine["decoder_weights"] == ("float16" if cpu_runs_kernel() else "float32")  # the fp16 checkpoint's
    rss = report["peak_rss_mb"]  # each mode in its own process: the assistant's own footprint
    assert rss["main_only"] > 100 and rss["assistant_share"] == pytest.approx(
        (rss["speculative"] - rss["main_only"]) / rss["main_only"]
    )
    # Loading's transient copies may set both lifetime peaks, and decoding's transient buffers move the
    # serving peaks by tens of MB between runs; once loaded, the draft's int8 weights (~50 MB for base)
    # are resident in the speculative process only.
    assert rss["main_only_serving"] > 100 and rss["speculative_serving"] > 100
    assert rss["main_only_loaded"] > 100 and rss["speculative_loaded"] > rss["main_only_loaded"] + 20
    assert rss["assistant_share_loaded"] == pytest.approx(
        (rss["speculative_loaded"] - rss["main_only_loaded"]) / rss["main_only_loaded"]
    )


def test_clip_selection_by_language_subset_and_length(benchdata: Path) -> None:
    manifest = benchdata / "manifest.jsonl"
    entries = read_manifest(manifest)
    short = select_clips(manifest, {"en"}, None)
    assert short and all(e.language == "en" and e.duration_s <= 30 for e in short)
    assert len(short) == sum(e.language == "en" and e.duration_s <= 30 for e in entries)
    long = select_clips(manifest, None, None, subset="long")
    assert long and all(e.subset == "long" and e.duration_s > 60 for e in long)
    assert [e.id for e in select_clips(manifest, {"de"}, 2, subset="short")] == [
        e.id for e in entries if e.language == "de"
    ][:2]
    assert all(e.audio.is_file() for e in entries)  # paths resolved against the manifest's folder
    with pytest.raises(ValueError, match="no clips"):
        select_clips(manifest, {"en"}, None, max_seconds=0.5)


@pytest.mark.slow  # five decodings of each clip, faster-whisper in a child process
def test_bench_compares_beam_search_with_greedy_and_faster_whisper(benchdata: Path, tmp_path: Path) -> None:
    """`bench --beam 1,5` runs greedy and beam-5 decoding, plain and speculative, and faster-whisper's beam 5 on
    the same clips and reports the beam-search targets as ratios of that run."""
    report = _bench(
        benchdata, tmp_path, "--languages", "en", "--limit", "3", "--beam", "1,5", "--compare-faster-whisper",
        "--no-rss-split",
    )  # fmt: skip
    greedy, beam = report["beams"]["1"], report["beams"]["5"]
    assert greedy["clips"] == beam["clips"] == 3
    assert greedy["identical_fraction"] == beam["identical_fraction"] == 1.0
    assert beam["wer_main"] == beam["wer_spec"] < 0.5
    assert beam["faster_whisper"]["wer"] < 0.5 and beam["faster_whisper"]["total_ms"] > 0
    targets = report["beam_targets"]
    assert targets["beam_spec_identical_to_beam_plain"] == 1.0
    for key in (
        "beam_spec_decode_speedup_vs_beam_plain",
        "beam_spec_e2e_speedup_vs_faster_whisper_beam",
        "beam_spec_e2e_vs_greedy_spec",
    ):
        assert targets[key] > 0, key
    assert targets["wer_points_beam_spec_minus_faster_whisper_beam"] == pytest.approx(
        100 * (beam["wer_spec"] - beam["faster_whisper"]["wer"]), abs=1e-3
    )
    per_clip = {(c["id"], c["beam_size"]) for c in report["per_clip"]}
    assert len(per_clip) == 6


@pytest.mark.slow  # two engines, every language, a noise condition
@pytest.mark.skipif(not cpu_runs_kernel(), reason="int8 runs on this project's kernel")
def test_precision_bench_compares_float32_and_int8(benchdata: Path, tmp_path: Path) -> None:
    """`bench-precision`: both dtypes on the same clips in one run, each exact against its own main-only decoding
    (alone and in a batch of 4), with the encoder's time a window, WER per set (English clean, under noise and over
    a telephone line here) and the ratios to float32; with a dithered run, each set's WER spread, the clean run
    within it."""
    out_json = tmp_path / "precision.json"
    args = ("--manifest", str(benchdata / "manifest.jsonl"), "--languages", "en", "--per-set", "4")
    args += ("--condition-clips", "1", "--dithers", "1")
    out = run_app("bench-precision", *args, "--json", str(out_json), timeout=900)
    assert out.returncode == 0, out.stderr
    report = json.loads(out_json.read_text())
    assert report["against"] == "float32" and set(report["dtypes"]) == {"float32", "int8"}
    assert report["engines"]["int8"]["dtype"] == "int8" and report["engines"]["float32"]["dtype"] == "float32"
    for dtype, figures in report["dtypes"].items():
        assert figures["all"]["identical_fraction"] == 1.0 and figures["batch_identical_fraction"] == 1.0, dtype
        assert figures["encoder_ms_per_window"] > 0 and figures["all"]["tokens_per_main_pass"] > 1
        assert set(figures["sets"]) == {"en", *SPOKEN_CONDITIONS}
        assert figures["sets"]["en"]["clips"] == 4 and figures["sets"]["en"]["wer"] < 0.25
        for name, one in figures["sets"].items():
            assert one["runs"] == 2 and one["wer_min"] <= one["wer"] <= one["wer_max"], name
            assert one["wer_mean"] == pytest.approx((one["wer_min"] + one["wer_max"]) / 2), name
    ratios = report["ratios"]["int8"]
    assert ratios["encoder_speedup"] > 0 and ratios["spec_e2e_speedup_english"] > 0
    assert (
        set(ratios["wer_points_by_set"])
        == set(ratios["wer_mean_points_by_set"])
        == set(report["dtypes"]["int8"]["sets"])
    )
