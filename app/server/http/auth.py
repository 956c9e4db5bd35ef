"""API-key checks shared by the HTTP middleware and the WebSocket route (constant-time compares)."""

from __future__ import annotations

import hmac

# Browsers cannot set headers on a WebSocket: OpenAI's Realtime clients put the key in a subprotocol.
KEY_SUBPROTOCOL = "openai-insecure-api-key."


def bearer(header: str | None) -> str:
    header = header or ""
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


def authorized(token: str, keys: list[str]) -> bool:
    """True when no keys are configured or `token` is one of them; every key is compared in full."""
    if not keys:
        return True
    found = False
    for key in keys:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


def websocket_token(headers_authorization: str | None, subprotocols: list[str]) -> str:
    """The key of a WebSocket handshake: a Bearer header, else an `openai-insecure-api-key.` subprotocol."""
    token = bearer(headers_authorization)
    if token:
        return token
    for proto in subprotocols:
        if proto.startswith(KEY_SUBPROTOCOL):
            return proto[len(KEY_SUBPROTOCOL) :]
    return ""
