"""A loaded Whisper checkpoint as the engine uses it: encoder, lean decoder, tokenizer, decoding constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from app.engine.decoder import TextDecoder
from app.engine.encoder import AudioEncoder
from app.engine.logits import LogitRule, LogitRules, SuppressAtBegin, SuppressTokens, TimestampRules
from app.engine.tokenizer import WhisperTokenizer


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
    def encode(self, features: Tensor) -> Tensor:
        """Log-mel features [B, n_mels, 3000] -> encoder states [B, 1500, D] in the decoder's dtype.

        The encoder may run in a dtype of its own (`load_model(encoder_dtype=...)`).
        """
        if self.encoder is None:
            raise RuntimeError(f"{self.name} has no encoder (decoder-only assistant)")
        states = self.encoder(features.to(self.device, self.encoder.dtype))
        return cast(Tensor, states.to(self.decoder.dtype))

    def logit_rules(self, timestamps: bool = False) -> LogitRules:
        """Whisper's suppression rules for this vocabulary (timestamp rules come with timestamp mode)."""
        tok = self.tokenizer
        special = [tok.task_ids["transcribe"], tok.sot, tok.sot_prev, tok.no_speech]
        if "translate" in tok.task_ids:
            special.append(tok.task_ids["translate"])
        sot_lm = tok.backend.token_to_id("<|startoflm|>")
        if sot_lm is not None:
            special.append(int(sot_lm))
        if not timestamps:
            special += [tok.no_timestamps, *range(tok.timestamp_begin, self.decoder.vocab_size)]
        suppress = sorted(set(self.constants.suppress_tokens) | set(special))
        rules: list[LogitRule] = [
            SuppressTokens(tuple(suppress)),
            SuppressAtBegin(tuple(self.constants.begin_suppress_tokens)),
        ]
        if timestamps:
            rules.append(
                TimestampRules(
                    tok.timestamp_begin,
                    tok.eot,
                    tok.no_timestamps,
                    self.constants.max_initial_timestamp_index,
                )
            )
        return LogitRules(tuple(rules))
