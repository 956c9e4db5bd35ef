"""Load Whisper checkpoints (local HF dirs, converted CT2 dirs, hub ids) into engine models."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from app.model.decoder import TextDecoder
from app.model.encoder import AudioEncoder
from app.model.halflinear import halve_linears
from app.model.int8 import quantize_linears
from app.model.kernels import pack_linears
from app.model.native import kernel_extension
from app.model.tokenizer import VocabularyMismatchError, WhisperTokenizer
from app.model.tokentable import compact_table, share_table
from app.model.weights import WhisperDims
from app.model.whisper import GenerationConstants, WhisperModel
from app.store.catalog import EMBEDDED, ModelNotFoundError, ModelStore
from app.store.checkpoint import (
    CheckpointError,
    CheckpointTensors,
    HubUnreachableError,
    checkpoint_file,
    read_config,
    read_json,
)

log = logging.getLogger(__name__)


def _constants(ref: str, config: dict[str, Any]) -> GenerationConstants:
    try:
        path = checkpoint_file(ref, "generation_config.json")
    except HubUnreachableError as exc:  # optional, as in transformers: a cache may hold all but it
        log.warning("%s; using config.json's token lists", exc)
        path = None
    # No generation config: the model config's lists.
    data = read_json(path) if path is not None else config
    heads = data.get("alignment_heads") or []
    return GenerationConstants(
        suppress_tokens=tuple(data.get("suppress_tokens") or ()),
        begin_suppress_tokens=tuple(data.get("begin_suppress_tokens") or ()),
        alignment_heads=tuple((int(a), int(b)) for a, b in heads),
        max_initial_timestamp_index=int(data.get("max_initial_timestamp_index") or 50),
    )


class PrecisionError(ValueError):
    """The precision asked for does not run here (int8 on a GPU, or on a CPU the int8 kernel does not run on)."""


def int8_kernel(device: torch.device) -> Any:
    """The kernel library an int8 model runs on; PrecisionError where there is none (never another precision)."""
    if device.type != "cpu":
        raise PrecisionError(f"dtype int8 runs on CPUs; on {device} use float16 or bfloat16")
    ext = kernel_extension()
    if ext is None:
        raise PrecisionError(
            "dtype int8 needs this project's int8 kernel, which does not run here (an x86-64 CPU with AVX2 + FMA,"
            " and a prebuilt library or a C++ compiler: see the log above); use float32"
        )
    return ext


def is_settings_error(exc: BaseException) -> bool:
    """Whether `exc`, raised by load_model, means the settings name no usable model, so that trying
    again would fail the same way; not so for a hub out of reach, memory or a device."""
    if any(isinstance(e, HubUnreachableError) and not e.offline for e in (exc, exc.__cause__)):
        return False
    return isinstance(exc, ModelNotFoundError | CheckpointError | VocabularyMismatchError | PrecisionError)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype a model computes in: 'int8' models compute in float32 around their int8 products."""
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.float32}
    return names[dtype]


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
    encoder_dtype: torch.dtype | None = None,
    int8: bool = False,
    encoder_int8: bool | None = None,
    keep_encoder: bool = True,
    progress: bool = True,
) -> WhisperModel:
    """Load `ref` (see `ModelStore.resolve`) as an engine model on `device`.

    encoder_dtype: the encoder's own dtype (None: `dtype`); its states reach the decoder in `dtype`.
    int8: every linear layer int8 (`app.model.int8`), quantized here, the rest in float32 (`dtype` must be
    float32); encoder_int8: the encoder's own choice (None: as `int8`). PrecisionError where int8 cannot run.
    """
    device = device or torch.device("cpu")
    encoder_int8 = int8 if encoder_int8 is None else encoder_int8
    ext = int8_kernel(device) if int8 or encoder_int8 else None
    if (int8 and dtype != torch.float32) or (encoder_int8 and encoder_dtype not in (None, torch.float32)):
        raise PrecisionError("an int8 model computes in float32 around its int8 products")
    path = store.resolve(ref, progress=progress)
    try:
        config = read_config(path)
    except CheckpointError as exc:
        if Path(path).is_dir():
            raise
        raise ModelNotFoundError(
            f"{ref!r} is not a model directory, a model in {store.root} ({', '.join(store.installed()) or 'none'}),"
            f" or an embedded model ({', '.join(EMBEDDED)}); as a hub id: {exc}"
        ) from exc
    try:
        dims = WhisperDims.from_config(config)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    encoder: AudioEncoder | None = None
    dtype_under = {"model.encoder.": encoder_dtype} if encoder_dtype is not None else None
    with CheckpointTensors(path, device=device, dtype=dtype, dtype_under=dtype_under) as tensors:
        try:
            if not dims.decoder_only and keep_encoder:
                encoder = AudioEncoder.from_weights(dims, tensors)
            decoder = TextDecoder.from_weights(dims, tensors)
        except KeyError as exc:
            raise CheckpointError(f"{path}: no tensor {exc} (config.json does not match the weights)") from exc
        unread = tensors.unread("model.decoder.") + (tensors.unread("model.encoder.") if encoder is not None else [])
        if unread:
            raise CheckpointError(f"{path}: config.json does not account for {len(unread)} tensors, e.g. {unread[0]}")
    # fp32 on the CPU: products on oneDNN's kernels with prepacked weights (app/model/kernels.py); torch's default
    # GEMM streamed the decoder's few-row products at a fraction of the memory bandwidth (docs/history). From fp16
    # weights, the decoder's few-row products keep them in fp16 on this project's kernel instead (half the bytes
    # to read, app/model/halflinear.py), its tied projection and lookups reading one token table
    # (app/model/tokentable.py); its audio keys/values (1500 rows a window) and the encoder stay on oneDNN.
    # int8: every product on this project's kernel (app/model/int8.py), a quarter of the weights' bytes.
    # The encoder's products and the decoder's audio keys/values have 1500 rows a window: oneDNN's int8 matmul.
    if int8:
        quantize_linears(decoder, ext, many_rows=lambda name: name.endswith(".cross_kv"))
    else:
        if dtype == torch.float32 and device.type == "cpu":
            share_table(decoder)
            halve_linears(decoder, skip=lambda name: name.endswith(".cross_kv"))
        pack_linears(decoder)
    if encoder is not None and encoder_int8:
        quantize_linears(encoder, ext, many_rows=lambda name: True)
    elif encoder is not None:
        pack_linears(encoder)
    compact_table(decoder)
    tokenizer_file = checkpoint_file(path, "tokenizer.json")
    if tokenizer_file is None:
        raise CheckpointError(f"{path}: no tokenizer.json")
    tokenizer = WhisperTokenizer.from_file(tokenizer_file, vocab_size=dims.vocab_size)
    name = Path(path).name if Path(path).is_dir() else ref
    precision = "int8" if int8 else str(dtype).removeprefix("torch.")
    encoder_precision = "int8" if encoder_int8 else str(encoder.dtype if encoder else dtype).removeprefix("torch.")
    encoder_note = f", encoder {encoder_precision}" if encoder is not None and encoder_precision != precision else ""
    log.info("loaded %s from %s (%s, %s%s)", name, path, device, precision, encoder_note)
    return WhisperModel(
        name=name,
        encoder=encoder,
        decoder=decoder,
        tokenizer=tokenizer,
        constants=_constants(path, config),
        n_mels=dims.num_mel_bins,
        device=device,
        dtype=dtype,
        source=path,
    )
