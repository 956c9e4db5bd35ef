"""Multipart form fields as the official SDKs send them: a nested object arrives as `name[key]` fields, a list
as repeated `name[]` fields. A field the endpoint does not know is refused, naming it, as OpenAI does."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from app.api import errors


def _scalar(value: str) -> str | int | float:
    """A form value as the number it spells, if it spells one."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


async def object_field(request: Request, name: str) -> str | dict[str, Any] | None:
    """Field `name` of the request's form: its string (a plain value, or JSON for the caller to read), the
    object its `name[key]` fields spell (numbers as numbers), or None when it is absent."""
    form = await request.form()  # parsed already for the route's parameters: Starlette keeps it
    prefix = f"{name}["
    nested = {
        key[len(prefix) : -1]: _scalar(value)
        for key, value in form.multi_items()
        if key.startswith(prefix) and key.endswith("]") and isinstance(value, str)
    }
    plain = form.get(name)
    if nested and plain is not None:
        raise errors.bad_request(f"send {name} either as a value or as {name}[...] fields, not both", param=name)
    if plain is not None and not isinstance(plain, str):
        raise errors.bad_request(f"{name} must be a string or an object, not a file", param=name)
    return nested or plain


async def text_fields(request: Request, names: tuple[str, ...]) -> dict[str, str]:
    """The request's form fields among `names` that it sends, as strings."""
    form = await request.form()
    out: dict[str, str] = {}
    for name in names:
        value = form.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise errors.bad_request(f"{name} must be a value, not a file", param=name)
        out[name] = value
    return out


async def refuse_unknown(request: Request, known: frozenset[str], objects: frozenset[str] = frozenset()) -> None:
    """400 naming the first form field that is neither in `known` nor a `name[key]` field of one of `objects`."""
    form = await request.form()
    for key in form:
        base = key.split("[", 1)[0] if key.endswith("]") and not key.endswith("[]") else None
        if key not in known and base not in objects:
            raise errors.bad_request(f"Unrecognized request argument supplied: {key[:64]}", param=key[:64])
