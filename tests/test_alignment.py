"""The word alignment's dynamic time warping and median filter against openai-whisper's own (its `dtw_cpu`, and
the `median(-1)` of unfolded windows its `median_filter` takes on a CPU): the same path and the same values, ties
included, so that word times stay openai-whisper's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engine.alignment import _median_filter, dtw


def test_dtw_finds_openai_whispers_path_ties_included() -> None:
    timing = pytest.importorskip("whisper.timing")  # the `compare` extra, which the test command installs
    rng = np.random.default_rng(0)
    for k in range(200):
        n, m = int(rng.integers(1, 30)), int(rng.integers(1, 60))
        x = rng.integers(-3, 3, (n, m)).astype(np.float64) if k % 2 else rng.standard_normal((n, m))
        text, time = dtw(x)
        expected = timing.dtw_cpu(x)
        assert np.array_equal(text, expected[0]) and np.array_equal(time, expected[1]), (k, n, m)
    x = rng.standard_normal((140, 1500))  # a full window's shape
    assert all(np.array_equal(a, b) for a, b in zip(dtw(x), timing.dtw_cpu(x), strict=True))


def test_median_filter_gives_the_unfolded_windows_median() -> None:
    def unfolded_median(x: torch.Tensor, width: int) -> torch.Tensor:
        pad = width // 2
        return torch.nn.functional.pad(x, (pad, pad), mode="reflect").unfold(-1, width, 1).median(-1).values

    g = torch.Generator().manual_seed(0)
    for k in range(40):
        x = torch.randn(3, 7, 40, generator=g)
        if k % 2:
            x = torch.round(x * 2) / 2  # many equal values
        for width in (3, 5, 7):
            assert torch.equal(_median_filter(x, width), unfolded_median(x, width)), (k, width)
    x = torch.randn(8, 145, 1500, generator=g)
    assert torch.equal(_median_filter(x, 7), unfolded_median(x, 7))
    assert torch.equal(_median_filter(x[:, :, :3], 7), x[:, :, :3])  # too short to filter: as it was
