"""Thin HTTP routes: parse, call the serving layer, return."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, Response, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from app.api import errors
from app.api.types import hinted_language, hinted_prompt
from app.server.http.forms import object_field, refuse_unknown, text_fields
from app.server.http.limits import unless_disconnected
from app.server.serving.requests import LONG_FORM_FIELDS, TranscriptionRequest
from app.server.serving.service import TranscriptionService
from app.server.serving.status import ServerStatus

router = APIRouter()
CREATED = int(time.time())
# The form fields each endpoint knows: OpenAI's, then ours (docs: README, "Extensions"). Any other is a 400.
TRANSLATION_FIELDS = frozenset(
    {"file", "model", "prompt", "response_format", "temperature", "speculative", "chunking_strategy", *LONG_FORM_FIELDS}
)
SPEAKER_FIELDS = ("min_speakers", "max_speakers")  # WhisperX's names, as extra fields of a diarized request
TRANSCRIPTION_FIELDS = TRANSLATION_FIELDS | {
    "language", "timestamp_granularities[]", "stream", "include[]", "languages[]", "keywords[]",
    "known_speaker_names[]", "known_speaker_references[]", "diarize", *SPEAKER_FIELDS,
}  # fmt: skip
OBJECT_FIELDS = frozenset({"chunking_strategy"})


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events framing: one `data:` line of JSON per event."""
    async for event in events:
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


def _service(request: Request) -> TranscriptionService:
    return request.app.state.service  # type: ignore[no-any-return]


def _status(request: Request) -> ServerStatus:
    return request.app.state.status  # type: ignore[no-any-return]


async def _transcription(
    request: Request,
    task: str,
    file: UploadFile | None,
    model: str | None,
    language: str | None,
    prompt: str | None,
    response_format: str,
    temperature: float,
    granularities: list[str] | None,
    speculative: bool,
    stream: bool = False,
    include: list[str] | None = None,
    speakers: tuple[list[str] | None, list[str] | None, bool] = (None, None, False),
) -> Response:
    await refuse_unknown(request, TRANSCRIPTION_FIELDS if task == "transcribe" else TRANSLATION_FIELDS, OBJECT_FIELDS)
    if file is None:
        raise errors.bad_request("An audio file is required in the `file` field.", param="file")
    if not model:
        raise errors.bad_request("The `model` field is required.", param="model")
    data = await file.read()
    req = TranscriptionRequest(
        data=data,
        filename=file.filename,
        content_type=file.content_type,
        model=model,
        task=task,
        language=language if task == "transcribe" else None,
        prompt=prompt,
        response_format=response_format,
        temperature=temperature,
        timestamp_granularities=tuple(granularities or ()),
        speculative=speculative,
        stream=stream,
        chunking_strategy=await object_field(request, "chunking_strategy"),
        long_form=await text_fields(request, LONG_FORM_FIELDS),
        include=tuple(include or ()),
        known_speaker_names=tuple(speakers[0] or ()),
        known_speaker_references=tuple(speakers[1] or ()),
        speaker_bounds=await text_fields(request, SPEAKER_FIELDS),
        diarize=speakers[2],
    )
    if stream:
        events = await _service(request).transcribe_stream(req, request.state.request_id)
        return StreamingResponse(
            sse(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(events.aclose),  # its places go back even if no event was read
        )
    reply = await unless_disconnected(request, _service(request).transcribe(req, request.state.request_id))
    m = reply.metrics
    timing = ", ".join(f"{k};dur={m[k + '_ms']}" for k in ("queue", "encode", "decode"))
    return Response(reply.body, media_type=reply.media_type, headers={"x-timing-detail": timing})


FileField = Annotated[UploadFile | None, File()]
Text = Annotated[str | None, Form()]


# A known speaker's reference is a form field (a data URL): up to 10 s of audio in any format, 4 of them.
REFERENCE_FIELD_BYTES = 8 << 20


@router.post("/v1/audio/transcriptions", form_limits={"max_part_size": REFERENCE_FIELD_BYTES})
async def transcriptions(
    request: Request,
    file: FileField = None,
    model: Text = None,
    language: Text = None,
    prompt: Text = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
    speculative: Annotated[bool, Form()] = True,
    stream: Annotated[bool, Form()] = False,
    include: Annotated[list[str] | None, Form(alias="include[]")] = None,
    languages: Annotated[list[str] | None, Form(alias="languages[]")] = None,  # gpt-transcribe's
    keywords: Annotated[list[str] | None, Form(alias="keywords[]")] = None,
    known_speaker_names: Annotated[list[str] | None, Form(alias="known_speaker_names[]")] = None,
    known_speaker_references: Annotated[list[str] | None, Form(alias="known_speaker_references[]")] = None,
    diarize: Annotated[bool, Form()] = False,
) -> Response:
    return await _transcription(
        request,
        "transcribe",
        file,
        model,
        hinted_language(language, languages or ()),
        hinted_prompt(prompt, keywords or ()),
        response_format,
        temperature,
        timestamp_granularities,
        speculative,
        stream,
        include,
        (known_speaker_names, known_speaker_references, diarize),
    )


@router.post("/v1/audio/translations")
async def translations(
    request: Request,
    file: FileField = None,
    model: Text = None,
    prompt: Text = None,
    response_format: Annotated[str, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    speculative: Annotated[bool, Form()] = True,
) -> Response:
    return await _transcription(
        request, "translate", file, model, None, prompt, response_format, temperature, None, speculative
    )


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    ids = _service(request).models.ids
    data = [{"id": i, "object": "model", "created": CREATED, "owned_by": "specwhisper"} for i in ids]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id}")
async def model(request: Request, model_id: str) -> JSONResponse:
    if not _service(request).models.accepts(model_id):
        raise errors.model_not_found(model_id)
    return JSONResponse({"id": model_id, "object": "model", "created": CREATED, "owned_by": "specwhisper"})


@router.get("/health/live")
async def live() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    body, is_ready = _status(request).readiness()
    return JSONResponse(body, status_code=200 if is_ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(_status(request).exposition().decode(), media_type=CONTENT_TYPE_LATEST)
