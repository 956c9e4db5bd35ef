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


def log_mel(audio: np.ndarray, n_mels: int, padding: int = 0) -> Tensor:
    """16-kHz samples (plus `padding` zeros) -> log-mel [n_mels, frames] with Whisper's normalization."""
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
