"""Audio input: decode any common container/codec to 16 kHz mono float32.

soundfile (libsndfile) reads WAV/FLAC/OGG-Vorbis/Opus/MP3 directly; PyAV (FFmpeg)
takes everything else (m4a/AAC, webm, video containers). Resampling uses soxr.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16000
BLOCK_SAMPLES = 1 << 20  # interleaved samples read at a time: memory stays bounded by the output


class AudioError(ValueError):
    """The input is not decodable audio, or holds no samples."""


class _Upload(io.BytesIO):
    """The bytes libsndfile reads through its virtual I/O. A corrupt header can make it seek before
    the start; BytesIO would raise inside soundfile's C callback, where the exception is only
    printed (a traceback in the server log per bad upload). Clamping keeps it a parse error."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: len(self.getbuffer())}[whence]
        return super().seek(max(0, base + offset))


def _to_mono_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    samples = np.asarray(samples, dtype=np.float32)
    if not np.all(np.isfinite(samples)):
        raise AudioError("audio contains NaN or infinite samples")
    if rate != SAMPLE_RATE:
        samples = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    return samples


class AudioTooLongError(AudioError):
    """The audio lasts longer than the allowed maximum."""


def _too_long(seconds: float, limit: float | None) -> None:
    if limit is not None and seconds > limit:
        raise AudioTooLongError(f"audio lasts {seconds:.0f} s, more than the allowed {limit:g} s")


def _decode_with_av(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise AudioError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            chunks = []
            samples = 0
            for frame in container.decode(streams[0]):
                for out in resampler.resample(frame):
                    chunk = out.to_ndarray().reshape(-1)
                    chunks.append(chunk)
                    samples += chunk.size
                _too_long(samples / SAMPLE_RATE, max_seconds)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except MemoryError as exc:
        raise AudioError("the audio is too large to decode") from exc
    except Exception as exc:  # PyAV raises many error types for bad input
        raise AudioError(f"could not decode audio: {exc}") from exc
    if not chunks:
        return np.zeros(0, dtype=np.float32), SAMPLE_RATE
    return np.concatenate(chunks).astype(np.float32), SAMPLE_RATE


def decode_audio(data: bytes, max_seconds: float | None = None) -> np.ndarray:
    """Encoded audio bytes -> float32 samples at 16 kHz, mono.

    With `max_seconds`, longer audio is refused from its header (or while decoding,
    for formats without a reliable length) before it is held in memory.
    """
    if not data:
        raise AudioError("the audio file is empty")
    try:
        source = sf.SoundFile(_Upload(data))
    except Exception:
        samples, rate = _decode_with_av(data, max_seconds)
        audio = _to_mono_16k(samples, rate)
    else:
        with source:
            audio = _decode_with_soundfile(source, max_seconds)
    if audio.size == 0:
        raise AudioError("the audio holds no samples")
    return audio


def _decode_with_soundfile(source: sf.SoundFile, max_seconds: float | None) -> np.ndarray:
    """Read in blocks, mixing down and resampling each: a file with many channels at a high rate
    (a few MB of FLAC can expand to GBs of float32) never lives in memory at its own rate."""
    rate, channels = source.samplerate, source.channels
    if rate <= 0 or channels <= 0:
        raise AudioError("the audio header is invalid")
    _too_long(source.frames / rate, max_seconds)
    resampler = None
    if rate != SAMPLE_RATE:
        resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
    chunks: list[np.ndarray] = []
    produced = 0
    try:
        for block in source.blocks(blocksize=max(1, BLOCK_SAMPLES // channels), dtype="float32", always_2d=True):
            mono = block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0].copy()
            if not np.all(np.isfinite(mono)):
                raise AudioError("audio contains NaN or infinite samples")
            out = resampler.resample_chunk(mono) if resampler is not None else mono
            chunks.append(out)
            produced += out.size
            _too_long(produced / SAMPLE_RATE, max_seconds)
        if resampler is not None:
            chunks.append(resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    except AudioError:
        raise
    except MemoryError as exc:
        raise AudioError("the audio is too large to decode") from exc
    except Exception as exc:
        raise AudioError(f"could not decode audio: {exc}") from exc
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)


def load_audio(path: str | Path) -> np.ndarray:
    return decode_audio(Path(path).read_bytes())


G711 = {"g711_ulaw": "ULAW", "g711_alaw": "ALAW"}  # raw 8-kHz telephone audio, one byte a sample
G711_RATE = 8000


def decode_raw(data: bytes, encoding: str) -> np.ndarray:
    """Headerless mono audio as float32 samples in [-1, 1), at its own rate: `pcm16` (little-endian 16-bit;
    an even number of bytes) or G.711 `g711_ulaw` / `g711_alaw` (8 kHz, decoded by libsndfile). AudioError if
    the bytes cannot be such audio."""
    if encoding == "pcm16":
        if len(data) % 2:
            raise AudioError("pcm16 audio must have an even number of bytes")
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    if encoding not in G711:
        raise AudioError(f"unknown raw audio encoding {encoding!r}")
    if not data:
        return np.zeros(0, dtype=np.float32)
    samples, _ = sf.read(
        io.BytesIO(data), format="RAW", subtype=G711[encoding], samplerate=G711_RATE, channels=1, dtype="float32"
    )
    return np.asarray(samples, dtype=np.float32)


class LiveResampler:
    """Resamples a live stream to 16 kHz chunk by chunk, holding back only its filter's 1-2 ms (libswresample,
    through PyAV). soxr's streaming resampler, used for files, holds back output in bursts (at 8 kHz up to
    ~110 ms, ~60 ms on average), which would arrive at turn detection as that much later an end of speech,
    and be missing from a buffer committed by hand."""

    def __init__(self, rate: int) -> None:
        import av

        self.rate = rate
        self._swr = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """float32 samples at `rate` -> float32 samples at 16 kHz (nearly as many as they last)."""
        import av

        if samples.size == 0:  # libswresample takes no empty frame
            return np.zeros(0, np.float32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, np.float32).reshape(1, -1), "flt", "mono")
        frame.sample_rate = self.rate
        out = [f.to_ndarray().reshape(-1) for f in self._swr.resample(frame)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)
