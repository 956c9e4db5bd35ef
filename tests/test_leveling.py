"""`chunking_strategy=auto` levels a chunk's quiet voices towards its loudest (`app/server/serving/leveling.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from app.server.serving.chunking import Chunk
from app.server.serving.leveling import HEADROOM_DB, MAX_GAIN, level, leveled, regions_in

SR = 16000


def _tone(seconds: float, rms: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (rms * np.sqrt(2) * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_regions_are_found_in_the_chunks_pieces() -> None:
    chunk = Chunk(((1000, 5000), (9000, 12000)))  # 4000 + 3000 samples
    speech = [(0, 1500), (2000, 3000), (4500, 9500), (11000, 20000), (30000, 31000)]
    assert regions_in(chunk, speech) == [(0, 500), (1000, 2000), (3500, 4000), (4000, 4500), (6000, 7000)]
    assert regions_in(chunk, []) == []


def test_a_quiet_voice_is_raised_to_the_headroom_and_the_loud_one_is_kept() -> None:
    loud, quiet = _tone(2.0, 0.1), _tone(2.0, 0.1 * 10 ** (-40 / 20))
    pause = np.zeros(SR, np.float32)
    audio = np.concatenate([loud, pause, quiet])
    regions = [(0, loud.size), (loud.size + pause.size, audio.size)]
    out = leveled(audio, regions)
    assert np.array_equal(out[: loud.size], audio[: loud.size])  # the loudest region: gain 1
    raised = level(out[regions[1][0] :])
    assert 20 * np.log10(raised / level(loud)) == pytest.approx(-HEADROOM_DB, abs=0.01)
    ramp = out[loud.size : loud.size + pause.size]
    assert not ramp.any()  # silence stays silence whatever its gain
    assert out.dtype == np.float32 and np.abs(out).max() <= 1.0


def test_speech_within_the_headroom_is_left_alone_bit_for_bit() -> None:
    audio = np.concatenate(
        [_tone(1.0, 0.1), np.zeros(SR, np.float32), _tone(1.0, 0.1 * 10 ** (-(HEADROOM_DB - 1) / 20))]
    )
    regions = [(0, SR), (2 * SR, 3 * SR)]
    assert leveled(audio, regions) is audio
    assert leveled(audio, []) is audio


def test_the_gain_is_bounded_and_ramps_across_a_pause() -> None:
    hum = np.full(3 * SR, 1e-3, np.float32)  # a constant floor, so the envelope shows
    hum[:SR] = _tone(1.0, 0.1)
    hum[2 * SR :] = _tone(1.0, 0.1 * 10 ** (-80 / 20))  # 80 dB down: raised by MAX_GAIN only
    out = leveled(hum, [(0, SR), (2 * SR, 3 * SR)])
    assert level(out[2 * SR :]) / level(hum[2 * SR :]) == pytest.approx(MAX_GAIN, rel=1e-3)
    gains = out[SR : 2 * SR] / hum[SR : 2 * SR]
    assert np.all(np.diff(gains) >= -1e-4) and gains[0] < 1.01 and gains[-1] > MAX_GAIN * 0.99
