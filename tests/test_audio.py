"""Audio decoding: common containers and codecs, resampling, limits, bad input."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf
import soxr
from scipy.signal import butter, sosfiltfilt

from app.api.audio import (
    SAMPLE_RATE,
    AudioError,
    AudioTooLongError,
    EncodedAudio,
    LiveResampler,
    SampleReader,
    decode_audio,
    load_audio,
)


def _encode(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame_size = 960 if codec == "libopus" else 1024
        fmt = stream.codec_context.format.name
        for start in range(0, samples.size, frame_size):
            chunk = samples[start : start + frame_size]
            frame = av.AudioFrame.from_ndarray(
                (chunk * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
            )
            frame.sample_rate = rate
            resampler = av.AudioResampler(format=fmt, layout="mono", rate=rate)
            for f in resampler.resample(frame):
                for packet in stream.encode(f):
                    out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("container", "codec", "rate"),
    [
        ("mp3", "mp3", 44100),
        ("ogg", "libopus", 48000),
        ("ipod", "aac", 44100),
        ("webm", "libopus", 48000),
        ("flac", "flac", 22050),
    ],
)
def test_compressed_formats_decode_to_16k_mono(benchdata: Path, container: str, codec: str, rate: int) -> None:
    import soxr

    reference = load_audio(benchdata / "audio/whisper/jfk.wav")
    source = soxr.resample(reference, SAMPLE_RATE, rate).astype(np.float32)
    try:
        data = _encode(source, rate, container, codec)
    except (av.FFmpegError, ValueError) as exc:  # an FFmpeg build without this encoder
        pytest.skip(f"no {codec} encoder in this FFmpeg build: {exc}")
    decoded = decode_audio(data)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert abs(decoded.size / SAMPLE_RATE - 11.0) < 0.2
    # Same loudness envelope as the source (codecs shift phase, so compare 100-ms energies).
    n = min(decoded.size, reference.size) // 1600 * 1600
    env_ref = np.sqrt((reference[:n].reshape(-1, 1600) ** 2).mean(1))
    env_dec = np.sqrt((decoded[:n].reshape(-1, 1600) ** 2).mean(1))
    assert np.corrcoef(env_ref, env_dec)[0, 1] > 0.9


def test_stereo_and_rates_are_converted() -> None:
    t = np.arange(44100 * 2) / 44100
    left = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, left], axis=1), 44100, format="WAV")
    out = decode_audio(buf.getvalue())
    assert out.size == pytest.approx(2 * SAMPLE_RATE, abs=2)
    assert 0.6 < float(np.abs(out).max()) < 1.1


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(AudioError, match="empty"):
        decode_audio(b"")
    with pytest.raises(AudioError):
        decode_audio(b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(AudioError):
        decode_audio(np.random.default_rng(0).bytes(5000))
    buf = io.BytesIO()
    sf.write(buf, np.array([0.0, np.nan, 0.1], dtype=np.float32), 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        decode_audio(buf.getvalue())


def test_duration_limit_is_checked_before_decoding() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(16000 * 20, dtype=np.int16), 16000, format="FLAC")
    with pytest.raises(AudioTooLongError):
        decode_audio(buf.getvalue(), max_seconds=10)
    assert decode_audio(buf.getvalue(), max_seconds=30).size == 16000 * 20


@pytest.mark.parametrize("rate", [8000, 24000])
def test_a_live_stream_is_resampled_as_it_comes(benchdata: Path, rate: int) -> None:
    """A live stream in 20-ms chunks (a phone line at 8 kHz, the Realtime API's 24 kHz): after every chunk, all
    but 2 ms of the audio so far is out at 16 kHz (what is held back reaches turn detection that much later, and
    a buffer committed by hand would miss it), and it is the audio a whole-file resample gives (below 7 kHz: the
    two filters' edges differ at the top of the band)."""
    speech = load_audio(sorted((benchdata / "audio" / "ljspeech").iterdir())[0])[: 5 * SAMPLE_RATE]
    sent = soxr.resample(speech, SAMPLE_RATE, rate).astype(np.float32)
    live, step, out = LiveResampler(rate), rate // 50, []
    for start in range(0, sent.size, step):
        out.append(live(sent[start : start + step]))
        assert live(np.zeros(0, np.float32)).size == 0  # an empty append (the API allows one) changes nothing
        produced = sum(o.size for o in out)
        assert produced >= (start + step) * SAMPLE_RATE // rate - 2 * SAMPLE_RATE // 1000
    whole = soxr.resample(sent, rate, SAMPLE_RATE)
    streamed = np.concatenate(out)
    n = min(streamed.size, whole.size)
    band = butter(8, 7000, fs=SAMPLE_RATE, output="sos")
    streamed, whole = sosfiltfilt(band, streamed[:n]), sosfiltfilt(band, whole[:n])
    assert np.linalg.norm(streamed - whole) < 0.01 * np.linalg.norm(whole)


@pytest.mark.parametrize(("container", "codec", "rate"), [("flac", "flac", 16000), ("ipod", "aac", 44100)])
def test_an_upload_read_as_a_stream_gives_the_same_samples(
    benchdata: Path, container: str, codec: str, rate: int
) -> None:
    """Each pass over an `EncodedAudio` gives the samples `decode_audio` gives, bit for bit, and a `SampleReader`
    cuts ranges of them (across blocks, after gaps longer than a block) while holding only the blocks it needs."""
    speech = load_audio(benchdata / "audio/whisper/jfk.wav")
    source = np.concatenate([speech, np.zeros(70 * SAMPLE_RATE, np.float32), speech])
    try:
        data = _encode(soxr.resample(source, SAMPLE_RATE, rate).astype(np.float32), rate, container, codec)
    except (av.FFmpegError, ValueError) as exc:
        pytest.skip(f"no {codec} encoder in this FFmpeg build: {exc}")
    whole = decode_audio(data)
    upload = EncodedAudio(data)
    assert np.array_equal(np.concatenate(list(upload.blocks())), whole)
    reader = SampleReader(upload.blocks())
    for start, end in [
        (0, 100),
        (50, 20000),
        (20000, 20001),
        (1_100_000, 1_300_000),
        (whole.size - 10, whole.size + 99),
    ]:
        assert np.array_equal(reader.take(start, end), whole[start:end])
    with pytest.raises(ValueError, match="let go"):
        reader.take(0, 10)


@pytest.mark.parametrize("seconds", [0.02, 0.77, 31.3, 75.0])
def test_the_log_mel_in_blocks_is_the_whole_stft_s(benchdata: Path, seconds: float) -> None:
    """Whisper's log-mel computed `MEL_BLOCK` frames at a time (what lets an hour-long upload cost ~115 MB in the
    worker, not ~1 GB) equals one STFT over all of it, bit for bit: speech and noise, with and without padding."""
    import torch

    from app.model.features import N_SAMPLES, _log_mel_whole, log_mel

    speech = load_audio(benchdata / "audio/fleurs/fleurs-de-009.wav")
    noise = np.random.default_rng(1).normal(0, 0.1, speech.size).astype(np.float32)
    n = int(seconds * SAMPLE_RATE)
    for audio in (np.resize(speech, n), noise[:n]):
        for padding in (0, N_SAMPLES):
            assert torch.equal(log_mel(audio, 80, padding), _log_mel_whole(audio, 80, padding))
