"""`/v1/realtime`: the WebSocket transport of a live transcription session."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from app.server.http.auth import KEY_SUBPROTOCOL, authorized, websocket_token
from app.server.realtime.session import Closing, RealtimeSession
from app.server.serving.live import LiveService, TooManySessions

router = APIRouter()
log = logging.getLogger("specwhisper.realtime")
FLUSH_TIMEOUT_S = 2.0


def _subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer with: `realtime` when offered, else the first one that is not a key."""
    if "realtime" in offered:
        return "realtime"
    return next((p for p in offered if not p.startswith(KEY_SUBPROTOCOL)), None)


def _beta(header: str | None) -> bool:
    """Whether the client asked for the beta protocol (`OpenAI-Beta: realtime=v1`)."""
    return header is not None and "realtime=v1" in header.replace(" ", "").split(",")


async def _refuse(ws: WebSocket, subprotocol: str | None, code: str, message: str, close_code: int) -> None:
    await ws.accept(subprotocol=subprotocol)
    error = {"type": "invalid_request_error", "code": code, "message": message, "param": None, "event_id": None}
    await ws.send_text(json.dumps({"event_id": "event_refused", "type": "error", "error": error}))
    await ws.close(close_code, message[:120])


async def _send(ws: WebSocket, session: RealtimeSession) -> None:
    while True:
        event = await session.outbound.get()
        await ws.send_text(json.dumps(event, ensure_ascii=False))
        session.outbound.task_done()


async def _receive(ws: WebSocket, session: RealtimeSession) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        text, data = message.get("text"), message.get("bytes")
        try:
            session.handle(text if text is not None else data or b"")
        except Closing as closing:
            session.close(closing)
            return
        except Exception:  # a bug in handling one event must not end the session silently
            log.exception("realtime event failed")
            session.error("The server failed to handle this event.", "server_error")


async def _flush_and_close(ws: WebSocket, session: RealtimeSession, why: Closing) -> None:
    """Let the client read the events that explain why, then close (bounded: it may not be reading)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(session.outbound.join()), FLUSH_TIMEOUT_S)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(why.code, str(why)[:120]), FLUSH_TIMEOUT_S)


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    service: LiveService = ws.app.state.service.live
    settings = service.settings
    offered = list(ws.scope.get("subprotocols") or [])
    subprotocol = _subprotocol(offered)
    if not authorized(websocket_token(ws.headers.get("authorization"), offered), settings.api_keys):
        await _refuse(ws, subprotocol, "invalid_api_key", "Incorrect or missing API key.", 1008)
        return
    intent = ws.query_params.get("intent")
    if intent not in (None, "transcription"):
        await _refuse(ws, subprotocol, "invalid_intent", "This server only serves intent=transcription.", 1008)
        return
    try:
        with service.live_session():  # raises TooManySessions on entry only
            await ws.accept(subprotocol=subprotocol)
            await _serve(ws, RealtimeSession(service, settings, beta=_beta(ws.headers.get("openai-beta"))))
    except TooManySessions:
        await _refuse(ws, subprotocol, "too_many_sessions", "Too many live sessions; retry later.", 1013)


async def _serve(ws: WebSocket, session: RealtimeSession) -> None:
    session.started()
    sender = asyncio.create_task(_send(ws, session))
    receiver = asyncio.create_task(_receive(ws, session))
    watched: set[asyncio.Future[object]] = {sender, receiver, session.doomed}  # type: ignore[arg-type]
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if session.doomed.done() and not sender.done():
            await _flush_and_close(ws, session, session.doomed.result())
    except WebSocketDisconnect:
        pass
    finally:
        for task in (sender, receiver):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await session.aclose()
