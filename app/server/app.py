"""The FastAPI app factory: the lifespan owns the engine (local worker or cluster client), the VAD and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import errors
from app.server.allocator import limit_heap
from app.server.http.auth import authorized, bearer
from app.server.http.limits import BodyLimit, ClientGone
from app.server.http.redact import install as redact_logs
from app.server.http.routes import router
from app.server.metrics import ServerMetrics
from app.server.realtime.route import router as realtime_router
from app.server.serving.service import TranscriptionService
from app.server.serving.status import ServerStatus
from app.server.vad import SileroVad
from app.server.web import STATIC
from app.server.web import router as web_router
from app.server.worker.client import EngineClient
from app.server.worker.local import LocalWorker
from app.settings import Settings

log = logging.getLogger("specwhisper.server")
PUBLIC_PATHS = ("/health/", "/metrics", "/stats", "/static/")
MULTIPART_OVERHEAD = 64 * 1024


def _load_in_background(load: Callable[[], object], what: str) -> asyncio.Future[object]:
    """`load()` in a thread, its failure logged: what the server loads while it already answers."""

    def report(task: asyncio.Future[object]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s could not be loaded: %s", what, task.exception())

    task = asyncio.ensure_future(asyncio.to_thread(load))
    task.add_done_callback(report)
    return task


def _error_response(err: errors.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=dict(err.headers))


EngineFactory = Callable[[Settings, ServerMetrics], EngineClient]


def create_app(
    settings: Settings | None = None,
    *,
    on_fatal: Callable[[str], None] | None = None,
    engine: EngineFactory | None = None,
    preload: bool = False,
    echo_request_id: bool = True,
) -> FastAPI:
    """The app; `on_fatal(reason)` is called when it can never serve (the worker cannot load the models).

    Without `on_fatal` such an app stays up and says why in `/health/ready` and in its 503s;
    `python -m app serve` passes one that stops the server with exit status 1.
    `engine` makes the engine the lifespan starts: a worker process of this machine (`LocalWorker`) unless
    given (on Ray Serve, the engine replicas' client). `preload`: start-up waits for the VAD (Ray Serve sends an
    ingress replica requests once its start-up is done); otherwise it loads while the server already answers.
    `echo_request_id`: answer with the request's `X-Request-Id` (Serve's proxy does that itself).
    """
    settings = settings or Settings()
    metrics = ServerMetrics()

    def local(settings: Settings, metrics: ServerMetrics) -> EngineClient:
        return LocalWorker(settings, metrics, on_fatal)

    make_engine = engine or local

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redact_logs(settings.api_keys)  # uvicorn has configured logging by now
        limit_heap(arenas=2, mmap_threshold=256 << 10)  # before the upload threads start (`allocator.py`)
        client = make_engine(settings, metrics)
        vad = SileroVad()
        service = TranscriptionService(settings, client, metrics, vad)
        app.state.service = service
        app.state.status = ServerStatus(client, metrics, service)
        await client.start()
        # While the worker loads its models (readiness waits for the VAD too); the server answers meanwhile.
        loading = [_load_in_background(vad.load, "the VAD (silero-vad)")]
        if preload:
            await asyncio.gather(*loading)
        try:
            yield
        finally:
            for task in loading:
                if not task.done():
                    task.cancel()
            log.info("shutting down: draining in-flight work (up to %.0f s)", settings.shutdown_timeout_s)
            await client.close(settings.shutdown_timeout_s)
            service.close()

    app = FastAPI(title="SpecWhisper", version="0.1.0", lifespan=lifespan)
    app.include_router(router)
    app.include_router(realtime_router)
    app.include_router(web_router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(errors.ApiError)
    async def api_error(_: Request, exc: errors.ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(errors.from_http(exc.status_code, str(exc.detail), exc.headers))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        metrics.requests_cancelled.inc()
        return Response(status_code=499)  # nobody reads it: recorded in the logs and metrics

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
        param = loc[-1] if loc else None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request"
        return _error_response(errors.bad_request(message, param=param))

    limit = settings.max_upload_bytes
    app.add_middleware(BodyLimit, limit=limit + MULTIPART_OVERHEAD, reported=limit)  # runs inside `guard`

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        response = _precheck(request, settings) or await call_next(request)
        elapsed = (time.perf_counter() - started) * 1000
        if echo_request_id:
            response.headers["X-Request-Id"] = request_id
        timing = f"total;dur={elapsed:.1f}"
        if extra := response.headers.get("x-timing-detail"):
            timing = f"{extra}, {timing}"
            del response.headers["x-timing-detail"]
        response.headers["Server-Timing"] = timing
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.requests.labels(route=path, status=str(response.status_code)).inc()
        return response

    return app


def _precheck(request: Request, settings: Settings) -> Response | None:
    """Authentication and the upload-size limit, before the body is read."""
    path = request.url.path
    public = path.startswith(PUBLIC_PATHS) or path == "/"
    if not public and not authorized(bearer(request.headers.get("authorization")), settings.api_keys):
        return _error_response(errors.unauthorized())
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + MULTIPART_OVERHEAD:
        return _error_response(errors.too_large(settings.max_upload_bytes))
    return None
