"""The shared helpers: the manifest reader, the /metrics parser, the CPU's flags, joining a split model.bin,
and the quick tier's guard against starting servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from app.model.cpu import cpu_flags, cpu_name
from app.store.ct2 import model_file
from app.tools.manifest import read_manifest, select, shortest
from app.tools.process import FORBID_START, ServerProcess
from app.tools.scrape import parse_metrics, sample_value


def test_manifest_clips_filters_and_order(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "audio": "audio/a.wav", "text": "A", "language": "en", "duration_s": 5, "subset": "short"},
        {"id": "b", "audio": "audio/b.wav", "text": "B", "language": "de", "duration_s": 2.5, "subset": "short"},
        {"id": "c", "audio": "audio/c.wav", "text": "C", "language": "en", "duration_s": 90, "subset": "long"},
        {"id": "d", "audio": "audio/d.wav", "text": "D", "language": "en", "duration_s": 0.5},
    ]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    clips = read_manifest(manifest)
    assert [c.id for c in clips] == ["a", "b", "c", "d"]
    assert clips[0].audio == tmp_path / "audio/a.wav" and clips[1].duration_s == 2.5 and clips[3].subset is None
    assert [c.id for c in select(clips, languages={"en"})] == ["a", "c", "d"]
    assert [c.id for c in select(clips, subset="long")] == ["c"]
    assert [c.id for c in select(clips, min_seconds=1, max_seconds=30)] == ["a", "b"]
    assert [c.id for c in shortest(clips, 2)] == ["d", "b"] and len(shortest(clips)) == 4


def test_metrics_are_parsed_by_sample_name_and_labels() -> None:
    registry = CollectorRegistry()
    Counter("x_requests", "requests", ["route", "status"], registry=registry).labels("/a", "200").inc(3)
    Counter("x_errors", "errors", ["code"], registry=registry)  # no label set used yet
    Histogram("x_batch", "batch sizes", buckets=(1, 2), registry=registry).observe(2)
    Gauge("x_depth", "depth", registry=registry).set(4)
    Info("x_engine", "engine", registry=registry).info({"dtype": "float32"})
    metrics = parse_metrics(generate_latest(registry).decode())
    assert sample_value(metrics, "x_requests_total", route="/a", status="200") == 3
    assert sample_value(metrics, "x_requests_total") is None  # labels must match exactly
    assert metrics["x_errors_total"] == []
    assert sample_value(metrics, "x_batch_bucket", le="1.0") == 0 and sample_value(metrics, "x_batch_count") == 1
    assert sample_value(metrics, "x_depth") == 4 and sample_value(metrics, "x_missing") is None
    assert metrics["x_engine_info"] == [({"dtype": "float32"}, 1.0)]


def test_cpu_flags_and_name() -> None:
    flags = cpu_flags()
    assert isinstance(flags, frozenset) and cpu_flags() is flags  # read once
    if Path("/proc/cpuinfo").is_file() and os.uname().machine == "x86_64":
        assert "sse2" in flags
    assert cpu_name()


def test_model_parts_are_joined_in_order(tmp_path: Path) -> None:
    parts = [tmp_path / "model.bin.part1", tmp_path / "model.bin.part2"]
    parts[0].write_bytes(b"abc")
    parts[1].write_bytes(b"def")
    joined = model_file(parts, tmp_path / "model.bin")
    assert joined == tmp_path / "model.bin" and joined.read_bytes() == b"abcdef"
    assert model_file(parts[:1], tmp_path / "one.bin") == parts[0] and not (tmp_path / "one.bin").exists()
    copied = model_file(parts[:1], tmp_path / "one.bin", reuse_single=False)
    assert copied == tmp_path / "one.bin" and copied.read_bytes() == b"abc"


def test_a_quick_test_cannot_start_a_server(request: pytest.FixtureRequest) -> None:
    """conftest forbids starting servers in tests that are not marked `server`: no server start-up can
    land in the quick tier unnoticed (this test is in it)."""
    assert request.node.get_closest_marker("quick") is not None
    assert os.environ.get(FORBID_START) == request.node.nodeid
    with pytest.raises(RuntimeError, match="mark the test `server`"):
        ServerProcess().launch()
