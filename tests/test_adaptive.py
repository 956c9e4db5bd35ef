"""The adaptive mode policy: it measures both modes, then follows the cheaper one per batch size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app.server.worker.policy import BatchCost, ModePolicy
from app.tools.manifest import read_manifest
from tests.conftest import run_app


def run(policy: ModePolicy, batch: int, cost: dict[str, float], batches: int) -> list[str]:
    """`batches` batches of 50 plain passes each, at the given seconds per plain pass of each mode."""
    chosen = []
    for _ in range(batches):
        mode = policy.choose(batch)
        chosen.append(mode)
        policy.observe(mode, batch, BatchCost(seconds=cost[mode] * 50, plain_passes=50))
    return chosen


def test_follows_the_cheaper_mode_per_batch_size_and_keeps_exploring() -> None:
    policy = ModePolicy(warmup=1, explore_every=10)
    small = run(policy, 1, {"speculative": 0.01, "plain": 0.03}, 100)
    large = run(policy, 4, {"speculative": 0.02, "plain": 0.008}, 100)
    close = run(policy, 2, {"speculative": 0.010, "plain": 0.011}, 100)
    assert small[:2] == ["speculative", "plain"]  # both measured first
    # A new size borrows the nearest verdict, then measures the other mode once.
    assert large[:2] == ["speculative", "plain"] and close[:2] == ["speculative", "plain"]
    # The loser runs once set aside (size 1 is not warmed here), once to learn, twice more while its estimate
    # is young (2 and 4 batches later: no other size backs the verdict), then one batch in 40 (it loses
    # by more than `clear_margin`).
    assert small.count("speculative") >= 93 and large.count("plain") >= 93
    assert "plain" in small[50:] and "speculative" in large[50:]  # estimates stay fresh
    assert 85 <= close.count("speculative") <= 92  # a close call is re-checked more often


def test_batch_cost_counts_the_longest_rows_plain_passes() -> None:
    # Plain decoding spends one pass per token and one on each window's end; rows run in lockstep.
    assert BatchCost.of(0.5, [(12, 1), (30, 2), (7, 1)]) == BatchCost(0.5, 32)


def test_short_clips_do_not_decide_the_verdict() -> None:
    """Speculation is cheaper on every clip, but least so on short ones, where the prompt and the
    end-of-text pass weigh most. Per generated token, a short clip run speculatively looks dearer
    than a long clip run plainly; per plain pass of its own content it does not."""
    clips = [  # (tokens, plain seconds, speculative seconds): 10 ms per plain pass
        (2, 0.030, 0.027),  # short: speculation saves 10%
        (40, 0.410, 0.205),  # long: it saves half
    ]
    policy = ModePolicy()
    chosen, spent = [], 0.0
    for i in range(200):
        tokens, plain, spec = clips[i % 2]
        mode = policy.choose(1)
        seconds = spec if mode == "speculative" else plain
        policy.observe(mode, 1, BatchCost.of(seconds, [(tokens, 1)]))
        chosen.append(mode)
        spent += seconds
    assert chosen[:4] == ["speculative", "plain"] * 2  # learning: the first batch of each mode is set aside
    assert chosen[4:].count("speculative") >= 180
    assert spent < 100 * (0.030 + 0.410) * 0.6  # within a few batches of always speculative (0.53)


def test_first_batch_of_a_mode_at_a_size_is_set_aside() -> None:
    policy = ModePolicy(warmup=1)
    cold = {"speculative": 0.03, "plain": 0.02}  # one-off costs make speculation look slower at first
    warm = {"speculative": 0.01, "plain": 0.02}
    first = run(policy, 1, cold, 2)
    later = run(policy, 1, warm, 50)
    assert first == ["speculative", "plain"] and later[:2] == ["speculative", "plain"]
    assert later[2:].count("speculative") >= 45


def test_sizes_warmed_before_the_first_request_trust_their_first_batches() -> None:
    """The worker's warm-up pays the one-off costs at one row and at its largest batch: there the first
    batch of each mode counts, which halves what learning costs; other sizes still set theirs aside."""
    policy = ModePolicy(warmed=frozenset({1, 4}))
    warmed = run(policy, 4, {"speculative": 0.01, "plain": 0.02}, 12)
    assert warmed[:3] == ["speculative", "plain", "speculative"] and warmed.count("plain") == 3
    cold = run(policy, 2, {"speculative": 0.01, "plain": 0.02}, 12)
    assert cold[:4] == ["speculative", "plain"] * 2 and cold.count("plain") == 2  # backed by size 4


def test_one_slow_batch_does_not_hand_the_verdict_to_the_dearer_mode() -> None:
    """Speculation is cheaper, but its first counted batch ran while the machine was busy and read four
    times slower. The loser's young estimate is re-measured 2 batches later, comes out cheaper than plain's, and
    replaces the slow one: speculation is back at once, where a verdict by more than `clear_margin` would
    otherwise have stood for 40 batches. Plain, now the young loser, is re-checked 2 and 4 batches later."""
    policy = ModePolicy(warmed=frozenset({1}))
    cost = {"speculative": 0.01, "plain": 0.015}
    policy.observe(policy.choose(1), 1, BatchCost(seconds=0.04 * 50, plain_passes=50))
    chosen = run(policy, 1, cost, 60)
    assert chosen[:7] == ["plain", "speculative", "plain", "speculative", "speculative", "speculative", "plain"]
    assert chosen[10:].count("speculative") >= 48


def test_a_burst_of_slow_batches_does_not_hold_the_verdict_after_it() -> None:
    """The storm's case: speculation (1.5x cheaper) runs every batch until a burst of load slows its whole window
    7x; plain, measured once during the burst too, then wins. Once the load is gone, speculation's first batch
    run to explore comes out cheaper than plain's estimate, and speculation is back from there (before, its
    median needed five such batches, one in 40 each: ~200 batches of plain)."""
    policy = ModePolicy(warmed=frozenset({1}))
    calm = {"speculative": 0.01, "plain": 0.015}
    run(policy, 1, calm, 30)
    burst = run(policy, 1, {"speculative": 0.07, "plain": 0.03}, 12)
    assert burst[-1] == "plain"
    after = run(policy, 1, calm, 60)
    first = after.index("speculative")
    assert first <= 40 and after[first:].count("plain") <= 3, after


def test_a_verdict_against_the_neighbouring_size_is_checked_again_soon() -> None:
    """At one row speculation is clearly cheaper. At two rows it is too, but the first counted batch
    of speculation there read slow: the verdict for plain, which size 1 does not back, is re-checked
    two batches later rather than one batch in 40 (and then speculation, cheaper, wins). A verdict that
    size 1 backs costs no extra batches of the losing mode."""
    policy = ModePolicy(warmed=frozenset({1, 2, 3}))
    cost = {"speculative": 0.01, "plain": 0.016}
    run(policy, 1, cost, 20)
    policy.observe(policy.choose(2), 2, BatchCost(seconds=0.04 * 50, plain_passes=50))
    disputed = run(policy, 2, cost, 40)
    assert disputed[:3] == ["plain", "speculative", "speculative"] and disputed[10:].count("speculative") >= 29
    backed = run(policy, 3, cost, 40)
    assert backed[:2] == ["speculative", "plain"] and backed.count("plain") == 1


def test_a_slow_batch_among_many_does_not_flip_a_clear_verdict() -> None:
    policy = ModePolicy(warmed=frozenset({2}))
    run(policy, 2, {"speculative": 0.01, "plain": 0.014}, 30)
    assert policy.choose(2) == "speculative"
    policy.observe("speculative", 2, BatchCost(seconds=0.05 * 50, plain_passes=50))
    assert run(policy, 2, {"speculative": 0.01, "plain": 0.014}, 5) == ["speculative"] * 5


def test_switches_when_costs_change() -> None:
    policy = ModePolicy(warmup=2, explore_every=5, window=4)
    run(policy, 2, {"speculative": 0.01, "plain": 0.02}, 30)
    later = run(policy, 2, {"speculative": 0.04, "plain": 0.02}, 40)  # e.g. acceptance collapsed
    assert later[-10:].count("plain") >= 8


def test_fixed_modes_and_validation() -> None:
    assert run(ModePolicy("always"), 4, {"speculative": 1.0, "plain": 0.1}, 5) == ["speculative"] * 5
    assert run(ModePolicy("never"), 1, {"speculative": 0.1, "plain": 1.0}, 5) == ["plain"] * 5
    with pytest.raises(ValueError, match="speculation"):
        ModePolicy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        ModePolicy(window=2)  # a median needs three batches; the young-verdict re-checks would never end
    snapshot = ModePolicy().snapshot()
    assert snapshot == {}


@pytest.mark.slow
@pytest.mark.server  # the bench command starts one per mode
def test_server_bench_compares_modes_through_real_servers(benchdata: Path, tmp_path: Path) -> None:
    """`python -m app bench --concurrency` starts a server per mode with the engine flags it was given."""
    manifest = benchdata / "manifest.jsonl"
    out = tmp_path / "concurrency.json"
    load = ["--concurrency", "1,2", "--limit", "2", "--requests-per-client", "1", "--rounds", "1", "--languages", "es"]
    engine_flags = ["--threads", "1"]  # not the default of a multi-core machine
    proc = run_app("bench", "--manifest", str(manifest), *load, *engine_flags, "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["clips"] == 2 and report["identical_texts"] is True
    assert set(report["engines"]) == {"adaptive", "always", "never"}
    for engine in report["engines"].values():
        assert engine["threads"] == 1 and engine["dtype"] == "float32"
    # The clips' own language reaches the server: Spanish comes back in Spanish, not translated.
    references = {c.id: c.text for c in read_manifest(manifest)}
    assert sorted(report["texts"]) == sorted(report["clip_ids"]) and all(
        c.startswith("fleurs/fleurs-es") for c in report["texts"]
    )
    for clip_id, text in report["texts"].items():
        said, heard = set(references[clip_id].lower().split()), set(re.findall(r"\w+", text.lower()))
        assert len(said & heard) >= 0.5 * len(said), (clip_id, text)
    modes = report["modes"]
    assert [level["concurrency"] for level in modes["adaptive"]] == [1, 2]
    assert all(level["speculative_fraction"] == 1 for level in modes["always"])
    assert all(level["speculative_fraction"] == 0 for level in modes["never"])
    assert all(level["throughput_audio_s_per_s"] > 0 and level["p50_latency_s"] > 0 for level in modes["adaptive"])
    for level in modes["adaptive"]:
        low, high = level["throughput_range"]
        assert low <= level["throughput_audio_s_per_s"] <= high
    assert [r["concurrency"] for r in report["ratios"]] == [1, 2]
    assert all(r["adaptive_vs_best_fixed"] > 0 for r in report["ratios"])
