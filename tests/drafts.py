"""Deliberately weak assistants for exactness tests: they make the main model reject often."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from app.engine.drafting.base import DraftLength
from app.engine.drafting.decoder import DecoderDrafter
from app.engine.drafting.int8 import int8_draft_decoder
from app.model.whisper import WhisperModel


def _add_noise(module: nn.Module, sigma: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim == 2:
                param.add_(torch.randn(param.shape, generator=gen) * param.std() * sigma)


def noisy_self_draft(
    main: WhisperModel, sigma: float, seed: int = 0, length: DraftLength | None = None
) -> DecoderDrafter:
    """The int8 self-draft of a main decoder whose layer weights got Gaussian noise (relative `sigma`)."""
    decoder = copy.deepcopy(main.decoder)
    _add_noise(decoder.layers, sigma, seed)
    return DecoderDrafter(f"noisy-self-draft({sigma})", int8_draft_decoder(decoder), "main-cross", length=length)


def decoder_only_checkpoint(base_dir: Path, into: Path, sigma: float) -> Path:
    """A distil-style assistant: the main encoder unchanged, a perturbed copy of the decoder.

    Its encoder equals the main one, so the engine drops it and drafts from the main encoder's output.
    """
    from transformers import WhisperForConditionalGeneration

    from tests.conftest import save_checkpoint

    hf = WhisperForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    _add_noise(hf.model.decoder.layers, sigma, seed=3)
    return save_checkpoint(hf, base_dir, into)


def noisy_encoder_checkpoint(base_dir: Path, into: Path, sigma: float) -> Path:
    """An encoder-decoder assistant with its own (perturbed) encoder."""
    from transformers import WhisperForConditionalGeneration

    from tests.conftest import save_checkpoint

    hf = WhisperForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    _add_noise(hf.model.encoder, sigma, seed=1)
    _add_noise(hf.model.decoder.layers, sigma, seed=2)
    return save_checkpoint(hf, base_dir, into)


def random_tiny_checkpoint(base_dir: Path, into: Path) -> Path:
    """A random-init tiny-shaped multilingual model: same vocabulary, useless drafts."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from tests.conftest import save_checkpoint

    torch.manual_seed(0)
    base_config = WhisperConfig.from_pretrained(base_dir)
    config = WhisperConfig(
        vocab_size=base_config.vocab_size,
        d_model=384,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        decoder_start_token_id=base_config.decoder_start_token_id,
        eos_token_id=base_config.eos_token_id,
        pad_token_id=base_config.pad_token_id,
        bos_token_id=base_config.bos_token_id,
    )
    return save_checkpoint(WhisperForConditionalGeneration(config), base_dir, into)
