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


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> Tensor:
    """Slaney-style mel filterbank [n_mels, N_FFT // 2 + 1], as Whisper uses."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(np.asarray(bank, dtype=np.float32)).T.contiguous()


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
