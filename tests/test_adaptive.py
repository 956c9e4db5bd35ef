"""The adaptive mode policy: it measures both modes, then follows the cheaper one per batch size."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engine.adaptive import ModePolicy
from app.serverbench import run_server_bench


def run(policy: ModePolicy, batch: int, cost: dict[str, float], batches: int) -> list[str]:
    chosen = []
    for _ in range(batches):
        mode = policy.choose(batch)
        chosen.append(mode)
        policy.observe(mode, batch, decode_seconds=cost[mode] * 50, tokens=50)
    return chosen


def test_follows_the_cheaper_mode_per_batch_size_and_keeps_exploring() -> None:
    policy = ModePolicy(warmup=1, explore_every=10)
    small = run(policy, 1, {"speculative": 0.01, "plain": 0.03}, 100)
    large = run(policy, 4, {"speculative": 0.02, "plain": 0.008}, 100)
    close = run(policy, 2, {"speculative": 0.010, "plain": 0.011}, 100)
    assert small[:2] == ["speculative", "plain"]  # both measured first
    # A new size borrows the nearest verdict, then measures the other mode once.
    assert large[:2] == ["speculative", "plain"] and close[:2] == ["speculative", "plain"]
    assert small.count("speculative") >= 95 and large.count("plain") >= 95
    assert "plain" in small[50:] and "speculative" in large[50:]  # estimates stay fresh
    assert 85 <= close.count("speculative") <= 92  # a close call is re-checked more often


def test_switches_when_costs_change() -> None:
    policy = ModePolicy(warmup=2, explore_every=5, weight=0.5)
    run(policy, 2, {"speculative": 0.01, "plain": 0.02}, 30)
    later = run(policy, 2, {"speculative": 0.04, "plain": 0.02}, 40)  # e.g. acceptance collapsed
    assert later[-10:].count("plain") >= 8


def test_fixed_modes_and_validation() -> None:
    assert run(ModePolicy("always"), 4, {"speculative": 1.0, "plain": 0.1}, 5) == ["speculative"] * 5
    assert run(ModePolicy("never"), 1, {"speculative": 0.1, "plain": 1.0}, 5) == ["plain"] * 5
    with pytest.raises(ValueError, match="speculation"):
        ModePolicy("sometimes")  # type: ignore[arg-type]
    snapshot = ModePolicy().snapshot()
    assert snapshot == {}


@pytest.mark.slow
def test_server_bench_compares_modes_through_real_servers(benchdata: Path) -> None:
    report = run_server_bench(benchdata / "manifest.jsonl", [1, 2], limit=2, requests_per_client=1, rounds=1)
    assert report["clips"] == 2 and report["identical_texts"] is True
    modes = report["modes"]
    assert [level["concurrency"] for level in modes["adaptive"]] == [1, 2]
    assert all(level["speculative_fraction"] == 1 for level in modes["always"])
    assert all(level["speculative_fraction"] == 0 for level in modes["never"])
    assert all(level["throughput_audio_s_per_s"] > 0 and level["p50_latency_s"] > 0 for level in modes["adaptive"])
    assert [r["concurrency"] for r in report["ratios"]] == [1, 2]
    assert all(r["adaptive_vs_best_fixed"] > 0 for r in report["ratios"])
