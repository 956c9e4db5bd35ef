"""Whisper's log-mel spectrogram (OpenAI's recipe), for clips of any length."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100
INPUT_STRIDE = 2  # mel frames per encoder output position (timestamp precision 0.02 s)
TIME_PRECISION = INPUT_STRIDE / FRAMES_PER_SECOND


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per 6.4x)."""
    mels = 3.0 * hz / 200.0
    above = hz >= 1000.0
    return np.where(above, 15.0 + np.log(np.where(above, hz, 1000.0) / 1000.0) * (27.0 / np.log(6.4)), mels)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = 200.0 * mels / 3.0
    above = mels >= 15.0
    return np.where(above, 1000.0 * np.exp((np.log(6.4) / 27.0) * (np.where(above, mels, 15.0) - 15.0)), hz)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> Tensor:
    """Slaney-style mel filterbank [n_mels, N_FFT // 2 + 1] from 0 to 8 kHz, area-normalized, as Whisper
    uses (librosa's `mel(norm="slaney")`).

    Computed here in float64, in the order transformers' `mel_filter_bank` computes it (the tests hold
    the two equal), because importing transformers for it cost every worker and CLI run ~1.5 s.
    """
    fft_hz = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(8000.0)), n_mels + 2))
    widths = np.diff(edges)
    offsets = edges[None, :] - fft_hz[:, None]  # [bins, n_mels + 2]
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    bank = np.maximum(0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return torch.from_numpy(bank.astype(np.float32)).T.contiguous()


MEL_BLOCK = 3000  # mel frames computed at a time


def log_mel(audio: np.ndarray, n_mels: int, padding: int = 0) -> Tensor:
    """16-kHz samples (plus `padding` zeros) -> log-mel [n_mels, frames] with Whisper's normalization.

    The STFT (centred: reflected at both ends) runs `MEL_BLOCK` frames at a time over the frames' own samples, so
    an hour of audio costs its log-mel (~115 MB) and not its complex spectrum too (~570 MB more); each frame's
    value is the one a single STFT over all of it gives, bit for bit (tests/test_audio.py holds this)."""
    length = audio.size + padding
    if audio.size == 0 or length <= N_FFT // 2:  # too short to reflect: as torch would (an error, or empty)
        return _log_mel_whole(audio, n_mels, padding)
    frames = length // HOP_LENGTH  # a centred STFT gives one more, which Whisper drops
    window = torch.hann_window(N_FFT)
    filters = mel_filters(n_mels)
    spec = torch.empty(n_mels, frames)
    for first in range(0, frames, MEL_BLOCK):
        last = min(frames, first + MEL_BLOCK)
        at = np.arange(first * HOP_LENGTH, (last - 1) * HOP_LENGTH + N_FFT) - N_FFT // 2  # in the padded audio
        at = np.where(at < 0, -at, at)  # reflected at the start ...
        at = np.where(at >= length, 2 * (length - 1) - at, at)  # ... and at the end
        samples = np.where(at < audio.size, audio[np.minimum(at, audio.size - 1)], 0).astype(np.float32)
        stft = torch.stft(
            torch.from_numpy(samples), N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True
        )
        spec[:, first:last] = (filters @ (stft.abs() ** 2)).clamp(min=1e-10).log10()
    spec = torch.maximum(spec, spec.max() - 8.0)
    return (spec + 4.0) / 4.0


def _log_mel_whole(audio: np.ndarray, n_mels: int, padding: int = 0) -> Tensor:
    """`log_mel` in one STFT over all of the audio (the definition the blocks are held to)."""
    samples = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    if padding:
        samples = torch.nn.functional.pad(samples, (0, padding))
    window = torch.hann_window(N_FFT)
    stft = torch.stft(samples, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    spec = (mel_filters(n_mels) @ power).clamp(min=1e-10).log10()
    spec = torch.maximum(spec, spec.max() - 8.0)
    return (spec + 4.0) / 4.0


def window(mel: Tensor, seek: int, frames: int = N_FRAMES) -> Tensor:
    """Frames [seek, seek + frames) of a log-mel, zero-padded to N_FRAMES (as OpenAI pads its windows)."""
    part = mel[:, seek : seek + frames]
    if part.shape[-1] < N_FRAMES:
        part = torch.nn.functional.pad(part, (0, N_FRAMES - part.shape[-1]))
    return part
