"""Request-level guards that sit below the routes: the body-size limit and client-disconnect cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import errors

T = TypeVar("T")


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413 while it streams in, before it is parsed or decoded.

    The Content-Length check in the HTTP middleware cannot see chunked uploads; this counts the bytes
    as they arrive, stops reading at the limit, and answers 413 instead of whatever the app would say.
    """

    def __init__(self, app: ASGIApp, limit: int, reported: int | None = None) -> None:
        self.app = app
        self.limit = limit
        self.reported = reported or limit  # the limit the client is told (without multipart overhead)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        refused = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    return {"type": "http.disconnect"}  # the app stops reading; we answer below
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the app's answer to a cut-off body is replaced by the 413
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise
        if refused and not started:
            err = errors.too_large(self.reported)
            # Close the connection: the rest of the body is not worth reading.
            await JSONResponse(err.body(), status_code=err.status, headers={"Connection": "close"})(
                scope, receive, send
            )


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its work was cancelled."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and the queued transcription behind it) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()
