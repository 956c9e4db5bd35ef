"""The browser page at `/` (static files, no build step) and the `/stats` snapshot its live panel polls."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from app.server.serving.status import ServerStatus

STATIC = Path(__file__).parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    status: ServerStatus = request.app.state.status
    return JSONResponse(status.live_counters(), headers={"Cache-Control": "no-store"})
