"""Assemble an engine from settings: load the main model and its assistant."""

from __future__ import annotations

import logging

import torch

from app.engine.drafting.assistants import NO_ASSISTANT, SELF_DRAFT, model_draft, self_draft
from app.engine.drafting.base import Drafter, DraftLength
from app.engine.engine import Engine
from app.engine.heap import heap_trimmer
from app.settings import Settings
from app.store.catalog import ModelStore
from app.store.loader import load_model, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


def build_engine(settings: Settings, *, progress: bool = True) -> Engine:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    store = ModelStore(settings.models_dir)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    encoder_name = settings.dtype if settings.encoder_dtype == "auto" else settings.encoder_dtype
    encoder_dtype = resolve_dtype(encoder_name, device)
    main = load_model(
        settings.model,
        store,
        device=device,
        dtype=dtype,
        encoder_dtype=encoder_dtype,
        int8=settings.dtype == "int8",
        encoder_int8=encoder_name == "int8",
        progress=progress,
    )
    if main.encoder is not None:
        main.encoder.attention_kernel = settings.encoder_attention
        main.encoder.rows_per_pass = settings.encoder_rows or (2 if device.type == "cpu" else None)
    main.decoder.attention = settings.decoder_attention
    length = DraftLength(initial=settings.draft_tokens, adaptive=settings.adaptive_draft)
    drafter: Drafter | None = None
    if settings.assistant == SELF_DRAFT:
        drafter = self_draft(main, length, kernel=settings.int8_kernel)
    elif settings.assistant != NO_ASSISTANT:
        assistant = load_model(
            settings.assistant, store, device=device, dtype=dtype, encoder_dtype=encoder_dtype, progress=progress
        )
        assistant.decoder.attention = settings.decoder_attention
        drafter = model_draft(main, assistant, length)
    # Loading, packing and quantizing freed hundreds of MB of temporaries that glibc would keep.
    trim = heap_trimmer()
    if trim is not None:
        trim()
    log.info("engine ready: main=%s assistant=%s", main.name, drafter.name if drafter else None)
    return Engine(main, drafter)
