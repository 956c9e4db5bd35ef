"""The GE2E speaker encoder (Wan et al., 2018) with the weights the `resemblyzer` wheel ships, run here.

The package itself is not imported (it imports webrtcvad and librosa at load); only its weight file is read
(`weights_only`, the model state alone). The encoder hears 40 mel bands of power (not log) every 10 ms over
25-ms windows, runs a 3-layer LSTM (256 units) over them, and maps its last hidden state through a linear
layer and a ReLU onto the unit sphere: a 256-d voice print. It was trained on partials of 1.6 s (160 frames).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from app.model.features import mel_filters
from app.speakers.windows import same_lengths

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms
HOP = 160  # 10 ms
N_MELS = 40
PARTIAL_FRAMES = 160  # the partials it was trained on: 1.6 s
HIDDEN = 256
LAYERS = 3


def weights_file() -> Path:
    """`pretrained.pt` of the installed `resemblyzer` wheel, found without importing the package."""
    spec = importlib.util.find_spec("resemblyzer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the speaker encoder's weights come with the resemblyzer wheel: pip install --no-deps resemblyzer==0.1.4"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pretrained.pt"


def mel_power(audio: Tensor) -> Tensor:
    """[n, samples] 16-kHz audio -> [n, frames, N_MELS] mel power (frames = samples // HOP + 1).

    Centred frames, the ends padded with zeros, a periodic Hann window, |STFT|², and the Slaney mel bank from 0
    to 8 kHz: librosa's `melspectrogram` defaults, which the encoder was trained on (a test holds the two equal).
    """
    window = torch.hann_window(N_FFT, dtype=audio.dtype)
    spectrum = torch.stft(audio, N_FFT, HOP, window=window, center=True, pad_mode="constant", return_complex=True)
    return (mel_filters(N_MELS) @ spectrum.abs().square()).transpose(1, 2)


class Ge2eEncoder(nn.Module):
    """[n, frames, N_MELS] mel power -> [n, HIDDEN] unit voice prints."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(N_MELS, HIDDEN, LAYERS, batch_first=True)
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, mels: Tensor) -> Tensor:
        _, (hidden, _) = self.lstm(mels)
        prints = torch.relu(self.linear(hidden[-1]))
        return prints / prints.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @classmethod
    def load(cls, path: Path | None = None) -> Ge2eEncoder:
        checkpoint = torch.load(path or weights_file(), map_location="cpu", weights_only=True)
        state = {k: v.clone() for k, v in checkpoint["model_state"].items() if k.startswith(("lstm.", "linear."))}
        encoder = cls()
        encoder.load_state_dict(state)  # strict: every weight of the architecture, and no other
        return encoder.eval()


TARGET_DBFS = -30.0  # resemblyzer's preprocessing raises quieter audio to this loudness before the encoder
MAX_GAIN_DB = 60.0


def loudness_levelled(window: np.ndarray) -> np.ndarray:
    """The window brought to TARGET_DBFS (raised by at most MAX_GAIN_DB). The encoder hears power, not log power:
    a quiet recording (FLEURS has clips at -65 dBFS) would otherwise print as near silence, every quiet voice
    alike, and one voice at two levels as two voices."""
    rms = float(np.sqrt(np.mean(np.square(window, dtype=np.float64)))) if window.size else 0.0
    gain_db = min(TARGET_DBFS - 20 * np.log10(max(rms, 1e-10)), MAX_GAIN_DB)
    return window * np.float32(10 ** (gain_db / 20))


class Ge2eEmbedder:
    """`SpeakerEmbedder` over the GE2E encoder: each window levelled (`loudness_levelled`), its mel power through
    the LSTM, in batches of windows of the same length. 16 windows a batch cost what 64 do per window (~5 ms
    each on a core) and a quarter of the memory: the LSTM projects every step of a batch at once (~10 MB a layer)."""

    name = "ge2e-resemblyzer"
    dim = HIDDEN
    window_s = PARTIAL_FRAMES * HOP / SAMPLE_RATE  # 1.6 s

    def __init__(self, encoder: Ge2eEncoder, batch: int = 16) -> None:
        self.encoder = encoder
        self.batch = batch

    @classmethod
    def load(cls, path: Path | None = None) -> Ge2eEmbedder:
        return cls(Ge2eEncoder.load(path))

    def embed(self, windows: list[np.ndarray]) -> np.ndarray:
        """Windows of 16-kHz float32 audio (any lengths) -> [len(windows), dim] float32 unit vectors."""
        out = np.zeros((len(windows), self.dim), np.float32)
        with torch.inference_mode():
            for indices in same_lengths(windows):
                for k in range(0, len(indices), self.batch):
                    part = indices[k : k + self.batch]
                    levelled = [loudness_levelled(windows[i]) for i in part]
                    audio = torch.from_numpy(np.stack(levelled).astype(np.float32, copy=False))
                    mels = mel_power(audio)[:, : max(1, audio.shape[1] // HOP)]
                    out[part] = self.encoder(mels).numpy()
        return out
