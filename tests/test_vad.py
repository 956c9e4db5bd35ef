"""Silero VAD (app/server/vad.py) on real speech, silence and noise; an upload's chunks and their timeline."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.api.types import InvalidRequestError
from app.server.serving.chunking import CHUNK_SECONDS, Chunk, plan
from app.server.serving.leveling import LocalLoudness, leveled, normalized, regions_in
from app.server.serving.speakers import SPEECH_VAD
from app.server.serving.uploads import AUTO_VAD, UPLOAD_VAD, AudioScan, Chunking, ChunkScan
from app.server.silero import RegionRules, TurnTracker
from app.server.vad import WINDOW, SileroVad, VadParams, server_vad, settled_regions

SR = 16000
SPEECH = "ljspeech/LJ001-0001"  # 9.7 s of read speech


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad().load()


def _noise(seconds: float, level: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, level, int(seconds * SR)).astype(np.float32)


def _tones(seconds: float) -> np.ndarray:
    """A chord of sustained tones, changing every half second: music-like, not speech."""
    t = np.arange(int(seconds * SR)) / SR
    notes = 220 * 2 ** (np.floor(t * 2) % 7 / 12)
    return (0.1 * (np.sin(2 * np.pi * notes * t) + np.sin(2 * np.pi * 1.5 * notes * t))).astype(np.float32)


def test_regions_find_the_speech_and_nothing_else(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    speech = clip(SPEECH)
    n = speech.size
    audio = np.concatenate([np.zeros(4 * SR, np.float32), speech, _noise(8, 0.05), speech, _tones(6)])
    first, second = (4 * SR, 4 * SR + n), (12 * SR + n, 12 * SR + 2 * n)
    params = VadParams(prefix_padding_ms=100)
    regions = vad.regions(audio, params)
    assert regions, "no speech found"
    pad = 3 * SR // 4  # the VAD's padding and its reaction time
    for start, end in regions:  # every region lies within one of the two copies of the speech
        assert any(a - pad <= start and end <= b + pad for a, b in (first, second)), (start / SR, end / SR)
    for a, b in (first, second):  # and covers most of it
        covered = sum(min(end, b) - max(start, a) for start, end in regions if end > a and start < b)
        assert covered > 0.8 * n
    assert vad.regions(_noise(10, 0.05), params) == []
    assert vad.regions(_tones(10), params) == []
    assert vad.regions(np.zeros(10 * SR, np.float32), params) == []


def test_regions_are_cut_at_pauses_to_fit_a_chunk(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    speech = np.concatenate([clip(SPEECH)] * 5)  # 48 s without a long pause
    regions = vad.regions(speech, VadParams(), max_seconds=CHUNK_SECONDS)
    assert len(regions) >= 2
    assert all(end - start <= CHUNK_SECONDS * SR for start, end in regions)


def test_regions_as_found_are_silero_s_regions(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    """Yielded while the VAD still listens, the regions are those the library finds over the whole upload."""
    from silero_vad import get_speech_timestamps, load_silero_vad

    rng = np.random.default_rng(3)
    speech = clip(SPEECH)
    parts = [np.zeros(SR // 3, np.float32)]
    for k in range(12):  # ~3 min: speech between pauses of 0.1-5 s, some of it in noise
        parts += [speech * (0.2 if k % 3 else 1.0), np.zeros(int(rng.uniform(0.1, 5) * SR), np.float32)]
        if k % 4 == 1:
            parts.append(_noise(2, 0.02, seed=k))
    audio = np.concatenate(parts)[: -SR // 7]  # ending mid-frame
    for params, max_seconds in ((VadParams(), CHUNK_SECONDS), (VadParams(0.3, 400, 2000, 100), 12.0)):
        expected = get_speech_timestamps(
            audio,
            load_silero_vad(onnx=True),
            threshold=params.threshold,
            min_speech_duration_ms=params.min_speech_duration_ms,
            min_silence_duration_ms=params.silence_duration_ms,
            speech_pad_ms=params.prefix_padding_ms,
            max_speech_duration_s=max_seconds,
        )
        assert len(expected) > 10
        assert vad.regions(audio, params, max_seconds) == [(r["start"], min(r["end"], audio.size)) for r in expected]
    # The first region comes before the VAD has heard the end: silenced after it came, the last minute has none.
    found = vad.regions_as_found(audio, VadParams())
    first = next(found)
    audio[-60 * SR :] = 0
    later = list(found)
    assert first[1] < 20 * SR and later and later[-1][1] < audio.size - 60 * SR
    # A finder asked for finer regions too finds, from the same probabilities, what a finder of its own finds.
    fine = VadParams(threshold=0.5, prefix_padding_ms=30, silence_duration_ms=300)
    finder = vad.finder(AUTO_VAD, CHUNK_SECONDS, fine)
    coarse = [r for start in range(0, audio.size, 65 * SR) for r in finder.feed(audio[start : start + 65 * SR])]
    coarse += finder.finish()
    assert coarse == vad.regions(audio, AUTO_VAD, CHUNK_SECONDS)
    assert finder.speech == vad.regions(audio, fine) and len(finder.speech) > len(coarse)


@given(
    st.lists(st.tuples(st.floats(0, 1), st.integers(1, 60)), min_size=1, max_size=40),
    st.lists(st.integers(1, 200), min_size=1, max_size=20),
    st.sampled_from([0, 250, 1000]),
    st.sampled_from([100, 500, 2000]),
    st.sampled_from([0, 30, 400]),
    st.sampled_from([2.0, 5.0, 30.0, float("inf")]),
    st.sampled_from([0.1, 0.5, 0.8]),
)
def test_a_region_is_yielded_once_no_later_audio_changes_it(
    runs: list[tuple[float, int]],
    blocks: list[int],
    min_speech: int,
    silence: int,
    pad: int,
    longest: float,
    threshold: float,
) -> None:
    """Any probabilities, in any blocks: the regions yielded as found are the library's over all of them."""
    from silero_vad.utils_vad import get_speech_timestamps_from_probs

    probs = [float(np.float32(p)) for p, n in runs for p in [p] * n]  # float32, as the model gives them
    rules = RegionRules(threshold, min_speech, silence, pad, longest)
    cuts = np.cumsum(blocks).tolist()
    parts = [probs[a:b] for a, b in zip([0, *cuts], [*cuts, len(probs)], strict=True) if a < len(probs)]
    length = len(probs) * WINDOW - 100
    expected = get_speech_timestamps_from_probs(
        probs,
        audio_length_samples=length,
        sampling_rate=SR,
        threshold=rules.threshold,
        min_speech_duration_ms=min_speech,
        min_silence_duration_ms=silence,
        speech_pad_ms=pad,
        max_speech_duration_s=longest,
    )
    assert list(settled_regions(parts, rules, length)) == [(r["start"], r["end"]) for r in expected]


def test_the_model_and_turns_are_the_silero_package_s(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    """Run without torch, many frames a call, the model gives the package's probabilities (its stock model, a frame a
    call), bit for bit, and the turn tracker the package's `VADIterator` starts and ends, on speech in silence and
    noise."""
    import torch
    from silero_vad import VADIterator, load_silero_vad

    speech = clip(SPEECH)
    gap = np.zeros(3 * SR, np.float32)
    audio = np.concatenate([_noise(1, 0.01), speech, gap, speech * 0.3, _noise(2, 0.05), gap])
    frames = audio[: audio.size // WINDOW * WINDOW].reshape(-1, WINDOW)
    package = load_silero_vad(onnx=True)
    with torch.no_grad():
        expected = [package(torch.from_numpy(frame), SR).item() for frame in frames]
    ours = vad.frames()
    probs = [p for start in range(0, len(frames), 700) for p in ours(frames[start : start + 700])]  # 512 + 188, ...
    assert probs == expected and max(probs) > 0.9 and min(probs) < 0.1
    for threshold, silence_ms in ((0.5, 500), (0.3, 100), (0.8, 2000)):
        iterator = VADIterator(load_silero_vad(onnx=True), threshold, SR, silence_ms, speech_pad_ms=0)
        tracker = TurnTracker(threshold, silence_ms)
        theirs = [iterator(torch.from_numpy(frame)) for frame in frames]
        mine = [tracker.step(p) for p in probs]
        assert [tuple(*t.items()) if t else None for t in theirs] == mine
        assert sum(m is not None for m in mine) >= 2


def test_stream_reports_turns_as_regions_do(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    speech = clip(SPEECH)
    audio = np.concatenate([np.zeros(3 * SR, np.float32), speech, _noise(4, 0.02), speech, np.zeros(SR, np.float32)])
    params = VadParams(silence_duration_ms=800, prefix_padding_ms=0)
    stream = vad.stream(params)
    events = []
    for i in range(0, audio.size, 1234):  # chunks that are no multiple of a frame
        events += stream.feed(audio[i : i + 1234])
    turns = [e for e in events if e.kind in ("start", "stop")]
    kinds = [e.kind for e in turns]
    assert kinds == ["start", "stop"] * (len(kinds) // 2) and len(kinds) >= 4
    assert abs(events[0].sample - 3 * SR) < 0.3 * SR
    # Each stop comes after a pause at the same sample (the silence it ends on began there, and nothing was
    # heard since); a pause that speech followed is resumed before its turn goes on.
    for i, event in enumerate(events):
        if event.kind == "stop":
            assert events[i - 1].kind == "pause" and events[i - 1].sample == event.sample, events[i - 1 : i + 1]
        if event.kind == "pause" and i + 1 < len(events):
            assert events[i + 1].kind in ("stop", "resume")
    events = turns
    assert events[-1].sample <= audio.size and not stream.speaking
    # a second stream keeps its own state: fed silence, it hears nothing while the first is mid-speech
    first, second = vad.stream(params), vad.stream(params)
    first.feed(audio[: 5 * SR])
    assert first.speaking and second.feed(np.zeros(2 * SR, np.float32)) == [] and not second.speaking


def test_params_are_openais_and_validated() -> None:
    assert server_vad(None, "x") is None
    p = server_vad({"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300}, "turn_detection")
    assert p == VadParams(threshold=0.7, silence_duration_ms=300)
    kept = server_vad({"prefix_padding_ms": 50, "create_response": True}, "t", current=p)
    assert kept == VadParams(threshold=0.7, silence_duration_ms=300, prefix_padding_ms=50)
    bad = [
        ({"threshold": 1.5}, "c.threshold"),
        ({"threshold": "high"}, "c.threshold"),
        ({"silence_duration_ms": -1}, "c.silence_duration_ms"),
        ({"prefix_padding_ms": True}, "c.prefix_padding_ms"),
        ({"min_speech_duration_ms": 20000}, "c.min_speech_duration_ms"),
        ({"type": "semantic_vad"}, "c.type"),
        ({"eagerness": "low"}, "c.eagerness"),
        ("auto", "c"),
    ]
    for raw, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            server_vad(raw, "c")
        assert info.value.param == param, raw


def test_plan_packs_whole_regions_into_chunks() -> None:
    regions = [(0, 10 * SR), (12 * SR, 25 * SR), (40 * SR, 50 * SR), (60 * SR, 100 * SR)]
    chunks = list(plan(regions))
    assert [c.pieces for c in chunks] == [
        ((0, 10 * SR), (12 * SR, 25 * SR)),
        ((40 * SR, 50 * SR),),
        ((60 * SR, 90 * SR),),
        ((90 * SR, 100 * SR),),
    ]
    assert all(c.samples <= CHUNK_SECONDS * SR for c in chunks)


@given(
    st.lists(st.tuples(st.integers(0, 5 * SR), st.integers(1, 12 * SR)), min_size=1, max_size=8),
    st.floats(0, 1),
)
def test_chunk_times_map_back_to_the_upload(gaps_and_lengths: list[tuple[int, int]], where: float) -> None:
    pieces, position = [], 0
    for gap, length in gaps_and_lengths:
        pieces.append((position + gap, position + gap + length))
        position += gap + length
    chunk = Chunk(tuple(pieces))
    audio = np.arange(position, dtype=np.float32)
    concatenated = chunk.audio(audio)
    k = min(int(where * concatenated.size), concatenated.size - 1)
    # sample k of the chunk is sample concatenated[k] of the upload
    assert chunk.to_original(k / SR) * SR == pytest.approx(concatenated[k], abs=1e-3)
    # a time on a seam: an end belongs to the piece before, a start to the piece after
    seam = (pieces[0][1] - pieces[0][0]) / SR
    if len(pieces) > 1:
        assert chunk.to_original(seam, is_end=True) == pytest.approx(pieces[0][1] / SR)
        assert chunk.to_original(seam) == pytest.approx(pieces[1][0] / SR)


def test_auto_levels_quiet_audio_for_the_vad_only_so_far(clip: Callable[[str], np.ndarray]) -> None:
    quiet = clip(SPEECH) * 0.003  # about -60 dBFS
    louder = normalized(quiet)
    assert 10 < np.abs(louder).max() / np.abs(quiet).max() <= 100
    assert np.array_equal(normalized(np.zeros(SR, np.float32)), np.zeros(SR, np.float32))
    loud = clip(SPEECH)
    heard = normalized(loud)
    assert np.all(np.abs(heard) >= np.abs(loud)) and np.abs(heard).max() == np.abs(loud).max()  # never turned down


def test_the_vad_hears_a_quiet_voice_after_a_loud_one(vad: SileroVad, clip: Callable[[str], np.ndarray]) -> None:
    """Levelled over the whole upload the loud voice sets the gain, and Silero did not hear the second one, 45 dB
    down; levelled locally it does. Fed in blocks of any size, the levelled audio is the same samples."""
    loud, quiet = clip(SPEECH), clip(SPEECH) * np.float32(10 ** (-45 / 20))
    audio = np.concatenate([loud, np.zeros(SR, np.float32), quiet])
    second = loud.size + SR
    assert not any(b > second + SR for _, b in vad.regions(audio, AUTO_VAD))
    heard = normalized(audio)
    assert any(a < second + SR and b >= audio.size - SR for a, b in vad.regions(heard, AUTO_VAD))
    assert np.abs(heard[: loud.size]).max() == np.abs(loud).max()  # the loud voice's loud frames as they are
    loudness, parts, at = LocalLoudness(), [], 0
    for size in (1, 511, 513, 20000, 7, audio.size):
        parts.append(loudness.feed(audio[at : at + size]))
        at += size
    assert np.array_equal(np.concatenate([*parts, loudness.finish()]), heard)


@pytest.mark.parametrize(
    ("rate", "chunking"), [(16000, Chunking(AUTO_VAD, True)), (44100, Chunking(UPLOAD_VAD, False))]
)
def test_an_upload_read_in_steps_gives_the_chunks_of_the_whole(
    vad: SileroVad, clip: Callable[[str], np.ndarray], rate: int, chunking: Chunking
) -> None:
    """The two passes over an encoded upload (loudness, then the VAD with a second decoder following behind) give
    the chunks, and the samples of each, that the VAD gives over the whole decoded upload, bit for bit."""
    import io

    import soundfile as sf
    import soxr

    from app.api.audio import EncodedAudio, decode_audio

    speech = clip(SPEECH)
    parts = [speech * 0.01, np.zeros(95 * SR, np.float32), speech, np.zeros(SR // 2, np.float32)]
    source = np.concatenate(parts + [speech * 0.3] * 4 + [np.zeros(3 * SR, np.float32), speech])
    buf = io.BytesIO()
    sf.write(buf, soxr.resample(source, SR, rate), rate, format="FLAC", subtype="PCM_16")
    audio = decode_audio(buf.getvalue())
    heard = normalized(audio) if chunking.normalize else audio
    expected = list(plan(vad.regions_as_found(heard, chunking.params, CHUNK_SECONDS)))
    assert len(expected) >= 3

    upload = EncodedAudio(buf.getvalue())
    first = AudioScan(upload)
    while not first.done:
        first.step()
    assert first.samples == audio.size
    finder = functools.partial(vad.finder, chunking.params, CHUNK_SECONDS, SPEECH_VAD)
    scan, found = ChunkScan(upload, finder, level=chunking.normalize), []
    while not scan.done:
        found += scan.step()
    assert [c for c, _ in found] == expected
    for chunk, samples in found:
        whole = chunk.audio(audio)
        assert np.array_equal(samples, leveled(whole, regions_in(chunk, scan.speech)) if chunking.normalize else whole)
