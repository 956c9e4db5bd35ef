"""A loaded Whisper checkpoint as the engine uses it: encoder, lean decoder, tokenizer, decoding constants."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from app.model.decoder import TextDecoder
from app.model.encoder import AudioEncoder
from app.model.tokenizer import WhisperTokenizer


@dataclass(frozen=True)
class GenerationConstants:
    """Decoding constants shipped with a checkpoint (its `generation_config.json`)."""

    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    alignment_heads: tuple[tuple[int, int], ...] = ()
    max_initial_timestamp_index: int = 50


@dataclass
class WhisperModel:
    """Encoder (None for a decoder-only assistant), decoder and vocabulary of one checkpoint."""

    name: str
    encoder: AudioEncoder | None
    decoder: TextDecoder
    tokenizer: WhisperTokenizer
    constants: GenerationConstants
    n_mels: int
    device: torch.device
    dtype: torch.dtype
    source: str = field(default="")

    @property
    def max_positions(self) -> int:
        return self.decoder.n_positions

    @torch.inference_mode()
    def encode(self, features: Tensor, between_layers: Callable[[], None] | None = None) -> Tensor:
        """Log-mel features [B, n_mels, 3000] -> encoder states [B, 1500, D] in the decoder's dtype.

        The encoder may run in a dtype of its own (`load_model(encoder_dtype=...)`). `between_layers()` is
        called after each encoder layer (a heartbeat; it may raise, to stop the pass).
        """
        if self.encoder is None:
            raise RuntimeError(f"{self.name} has no encoder (decoder-only assistant)")
        states = self.encoder(features.to(self.device, self.encoder.dtype), between_layers)
        return cast(Tensor, states.to(self.decoder.dtype))
