"""Turn an assistant choice into a drafter for a given main model."""

from __future__ import annotations

import torch
from torch import nn

from app.engine.drafting.base import DraftLength
from app.engine.drafting.decoder import DecoderDrafter
from app.engine.drafting.int8 import int8_draft_decoder
from app.model.tokenizer import check_same_vocabulary
from app.model.whisper import WhisperModel

SELF_DRAFT = "self-draft"
NO_ASSISTANT = "none"


def same_encoder(a: nn.Module, b: nn.Module) -> bool:
    """True when two encoders hold the same weights (distil-whisper keeps its teacher's encoder), compared in
    the coarser of their two dtypes (a bf16 copy of an fp32 encoder is the same encoder)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    for name in sa:
        x, y = sa[name], sb[name]
        if x.shape != y.shape:
            return False
        coarse = _coarser(x.dtype, y.dtype)
        if not torch.equal(x.to(y.device, coarse), y.to(coarse)):
            return False
    return True


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    if not (a.is_floating_point and b.is_floating_point):
        return a
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def self_draft(main: WhisperModel, length: DraftLength | None = None, kernel: bool = True) -> DecoderDrafter:
    """An int8 copy of the main decoder reading the main model's cross-attention keys/values.

    kernel: run its products on this project's int8 kernel where the CPU allows (`app.engine.drafting.int8`).
    """
    if main.device.type != "cpu":
        raise ValueError("the int8 self-draft runs on the CPU; use a distil-style assistant on a GPU")
    return DecoderDrafter(
        f"{SELF_DRAFT}({main.name}, int8)", int8_draft_decoder(main.decoder, kernel), "main-cross", length=length
    )


def model_draft(main: WhisperModel, assistant: WhisperModel, length: DraftLength | None = None) -> DecoderDrafter:
    """A separate checkpoint as assistant: decoder-only when it shares (or lacks) the main encoder."""
    check_same_vocabulary(main.tokenizer, main.name, assistant.tokenizer, assistant.name)
    if assistant.decoder.d_model != main.decoder.d_model and assistant.encoder is None:
        raise ValueError(
            f"decoder-only assistant {assistant.name!r} (width {assistant.decoder.d_model}) cannot read "
            f"the encoder of {main.name!r} (width {main.decoder.d_model})"
        )
    shares = assistant.encoder is None or (main.encoder is not None and same_encoder(assistant.encoder, main.encoder))
    if shares:
        assistant.encoder = None  # the main encoder's output serves both
        return DecoderDrafter(assistant.name, assistant.decoder, "main-encoder", length=length)
    return DecoderDrafter(assistant.name, assistant.decoder, "own-encoder", encoder_model=assistant, length=length)
