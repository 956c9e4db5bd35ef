"""Load Whisper checkpoints (local HF dirs, converted CT2 dirs, hub ids) into engine models."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from app.engine.decoder import TextDecoder
from app.engine.encoder import AudioEncoder
from app.engine.kernels import pack_linears
from app.engine.model import GenerationConstants, WhisperModel
from app.engine.tokenizer import WhisperTokenizer
from app.store.catalog import ModelStore

log = logging.getLogger(__name__)


def _file(ref: str, name: str) -> Path:
    local = Path(ref) / name
    if local.is_file():
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(ref, name))


def _constants(ref: str) -> GenerationConstants:
    try:
        data = json.loads(_file(ref, "generation_config.json").read_text())
    except Exception:  # no generation config: fall back to the model config's lists
        data = json.loads(_file(ref, "config.json").read_text())
    heads = data.get("alignment_heads") or []
    return GenerationConstants(
        suppress_tokens=tuple(data.get("suppress_tokens") or ()),
        begin_suppress_tokens=tuple(data.get("begin_suppress_tokens") or ()),
        alignment_heads=tuple((int(a), int(b)) for a, b in heads),
        max_initial_timestamp_index=int(data.get("max_initial_timestamp_index") or 50),
    )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(
    ref: str,
    store: ModelStore,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    keep_encoder: bool = True,
    progress: bool = True,
) -> WhisperModel:
    """Load `ref` (see `ModelStore.resolve`) as an engine model on `device`."""
    from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration
    from transformers.utils import logging as hf_logging

    device = device or torch.device("cpu")
    path = store.resolve(ref, progress=progress)
    config = WhisperConfig.from_pretrained(path)
    decoder_only = "WhisperForCausalLM" in (config.architectures or [])
    cls = WhisperForCausalLM if decoder_only else WhisperForConditionalGeneration
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        hf = cls.from_pretrained(path, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    hf.eval()
    encoder: AudioEncoder | None = None
    if not decoder_only and keep_encoder:
        encoder = AudioEncoder.from_hf(hf.model.encoder).to(device)
    decoder = TextDecoder.from_hf(hf).to(device)
    del hf
    # fp32 on the CPU: every product on oneDNN's kernels with prepacked weights (app/engine/kernels.py).
    # Torch's default GEMM streamed the decoder's 1..k-row products, above all the 100 MB vocabulary
    # projection, at a fraction of the memory bandwidth (docs/performance.md).
    pack_linears(decoder)
    if encoder is not None:
        pack_linears(encoder)
    tokenizer = WhisperTokenizer.from_file(_file(path, "tokenizer.json"), vocab_size=config.vocab_size)
    name = Path(path).name if Path(path).is_dir() else ref
    log.info("loaded %s from %s (%s, %s)", name, path, device, dtype)
    return WhisperModel(
        name=name,
        encoder=encoder,
        decoder=decoder,
        tokenizer=tokenizer,
        constants=_constants(path),
        n_mels=config.num_mel_bins,
        device=device,
        dtype=dtype,
        source=path,
    )
