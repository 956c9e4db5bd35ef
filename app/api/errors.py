"""API errors as values, mapped to OpenAI's error JSON and status codes in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)  # not frozen: Starlette clears `__traceback__` on the exceptions it handles
class ApiError(Exception):
    """An error the API reports to the client: `{"error": {"message", "type", "param", "code"}}`."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key.", type="invalid_request_error", code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Upload exceeds the limit of {limit} bytes.", param="file", code="file_too_large")


def unsupported_media(message: str) -> ApiError:
    return ApiError(415, message, param="file", code="unsupported_media_type")


def queue_full(retry_after: int) -> ApiError:
    return ApiError(
        429,
        "The server is at capacity; retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers=(("Retry-After", str(retry_after)),),
    )


def not_ready(message: str = "The model worker is not ready; retry shortly.", *, final: bool = False) -> ApiError:
    """503; `final`: it will not become ready (no Retry-After)."""
    headers = () if final else (("Retry-After", "2"),)
    return ApiError(503, message, type="server_error", code="not_ready", headers=headers)


def timeout(seconds: float) -> ApiError:
    return ApiError(504, f"Transcription did not finish within {seconds:g} s.", type="server_error", code="timeout")


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "file_too_large", 415: "unsupported_media_type"}


def from_http(status: int, detail: str, headers: Mapping[str, str] | None = None) -> ApiError:
    """A framework error (unknown route, wrong method, unparsable multipart body) in OpenAI's shape."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, detail, type=kind, code=HTTP_CODES.get(status), headers=tuple((headers or {}).items()))
