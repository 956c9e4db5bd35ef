"""Audio input: decode any common container/codec to 16 kHz mono float32.

soundfile (libsndfile) reads WAV/FLAC/OGG-Vorbis/Opus/MP3 directly; PyAV (FFmpeg)
takes everything else (m4a/AAC, webm, video containers). Resampling uses soxr.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16000
BLOCK_SAMPLES = 1 << 20  # interleaved samples read at a time: memory stays bounded by the output


def frame_rms(samples: np.ndarray, frame: int) -> np.ndarray:
    """[N] samples -> [N // frame] the RMS of each whole frame of `frame` samples (float64; no copy of the samples)."""
    n = samples.size // frame
    frames = samples[: n * frame].reshape(n, frame)
    return np.sqrt(np.einsum("ij,ij->i", frames, frames).astype(np.float64) / frame)  # type: ignore[no-any-return]


class AudioError(ValueError):
    """The input is not decodable audio, or holds no samples."""


class _Upload(io.BytesIO):
    """The bytes libsndfile reads through its virtual I/O. A corrupt header can make it seek before
    the start; BytesIO would raise inside soundfile's C callback, where the exception is only
    printed (a traceback in the server log per bad upload). Clamping keeps it a parse error."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: len(self.getbuffer())}[whence]
        return super().seek(max(0, base + offset))


class AudioTooLongError(AudioError):
    """The audio lasts longer than the allowed maximum."""


def _too_long(seconds: float, limit: float | None) -> None:
    if limit is not None and seconds > limit:
        raise AudioTooLongError(f"audio lasts {seconds:.0f} s, more than the allowed {limit:g} s")


def _av_blocks(data: bytes, max_seconds: float | None) -> Iterator[np.ndarray]:
    """FFmpeg's decoder through PyAV: a block per decoded frame, resampled to 16 kHz mono by libswresample."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise AudioError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            samples = 0
            for frame in container.decode(streams[0]):
                for out in resampler.resample(frame):
                    block = _finite(out.to_ndarray().reshape(-1))
                    samples += block.size
                    yield block
                _too_long(samples / SAMPLE_RATE, max_seconds)
            for out in resampler.resample(None):
                yield _finite(out.to_ndarray().reshape(-1))
    except AudioError:
        raise
    except MemoryError as exc:
        raise AudioError("the audio is too large to decode") from exc
    except Exception as exc:  # PyAV raises many error types for bad input
        raise AudioError(f"could not decode audio: {exc}") from exc


def _finite(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples, dtype=np.float32)
    if not np.all(np.isfinite(samples)):
        raise AudioError("audio contains NaN or infinite samples")
    return samples


def _soundfile_blocks(source: sf.SoundFile, max_seconds: float | None) -> Iterator[np.ndarray]:
    """libsndfile's decoder, `BLOCK_SAMPLES` at a time, each block mixed down and resampled (soxr, streaming): a
    file with many channels at a high rate (a few MB of FLAC can expand to GBs of float32) is never held whole."""
    with source:
        rate, channels = source.samplerate, source.channels
        if rate <= 0 or channels <= 0:
            raise AudioError("the audio header is invalid")
        _too_long(source.frames / rate, max_seconds)
        resampler = None
        if rate != SAMPLE_RATE:
            resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
        produced = 0
        try:
            for block in source.blocks(blocksize=max(1, BLOCK_SAMPLES // channels), dtype="float32", always_2d=True):
                mono = _finite(block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0].copy())
                out = resampler.resample_chunk(mono) if resampler is not None else mono
                produced += out.size
                _too_long(produced / SAMPLE_RATE, max_seconds)
                yield out
            if resampler is not None:
                yield resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        except AudioError:
            raise
        except MemoryError as exc:
            raise AudioError("the audio is too large to decode") from exc
        except Exception as exc:
            raise AudioError(f"could not decode audio: {exc}") from exc


@dataclass(frozen=True)
class EncodedAudio:
    """An upload as it came (`data`, a few hundred kB for an hour of FLAC), decoded again each time its samples
    are needed, as a stream of blocks: an hour of audio is ~230 MB as float32, so no reader holds more than a block.

    Every pass gives the same samples, in the same blocks. With `max_seconds`, longer audio is refused from its
    header (or while decoding, for formats without a reliable length) before it is decoded.
    """

    data: bytes
    max_seconds: float | None = None

    def blocks(self) -> Iterator[np.ndarray]:
        """The audio as float32 blocks at 16 kHz, mono, in order; AudioError (at once, or where decoding
        fails) if it is not decodable audio, holds no samples, or lasts too long."""
        if not self.data:
            raise AudioError("the audio file is empty")
        try:
            source = sf.SoundFile(_Upload(self.data))
        except Exception:
            blocks = _av_blocks(self.data, self.max_seconds)
        else:
            blocks = _soundfile_blocks(source, self.max_seconds)
        produced = 0
        for block in blocks:
            if block.size:
                produced += block.size
                yield block
        if produced == 0:
            raise AudioError("the audio holds no samples")

    def decode(self) -> np.ndarray:
        """All of it at once: float32 samples at 16 kHz, mono."""
        return np.concatenate(list(self.blocks())).astype(np.float32, copy=False)


def decode_audio(data: bytes, max_seconds: float | None = None) -> np.ndarray:
    """Encoded audio bytes -> float32 samples at 16 kHz, mono (`EncodedAudio.decode`)."""
    return EncodedAudio(data, max_seconds).decode()


class SampleReader:
    """Ranges of samples of a stream of blocks, read forward: `take(start, end)` decodes only as far as `end` and
    lets go of the blocks before `start` (a later range must not start before an earlier one's start)."""

    def __init__(self, blocks: Iterator[np.ndarray]) -> None:
        self._blocks = blocks
        self._held: list[np.ndarray] = []
        self._offset = 0  # the first held sample's position
        self._end = 0  # the position after the last held sample

    def take(self, start: int, end: int) -> np.ndarray:
        """Samples [start, end) (fewer where the stream ends first)."""
        if start < self._offset:
            raise ValueError(f"samples from {start} were let go (the reader is at {self._offset})")
        while True:
            while self._held and self._offset + self._held[0].size <= start:
                self._offset += self._held.pop(0).size
            if self._end >= end:
                break
            block = next(self._blocks, None)
            if block is None:
                break
            if not self._held:
                self._offset = self._end
            self._held.append(block)
            self._end += block.size
        held = np.concatenate(self._held) if len(self._held) > 1 else (self._held[0] if self._held else _EMPTY)
        return held[start - self._offset : end - self._offset].copy()


_EMPTY = np.zeros(0, dtype=np.float32)


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
