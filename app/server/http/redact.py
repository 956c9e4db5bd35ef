"""Keeps API keys out of every log line: access logs (keys pasted into URLs) and debug handshake dumps."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

PATTERNS = (
    (re.compile(r"(?i)(authorization:\s*)(bearer\s+)?[^\s'\",]+"), r"\1\2[redacted]"),
    (re.compile(r"(?i)(bearer\s+)[^\s'\",]+"), r"\1[redacted]"),
    (re.compile(r"openai-insecure-api-key\.[^\s'\",]+"), "openai-insecure-api-key.[redacted]"),
    (re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access_token|authorization)=)[^&\s'\"]+"), r"\1[redacted]"),
)
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "websockets", "websockets.server", "specwhisper")


class RedactSecrets(logging.Filter):
    def __init__(self, keys: Iterable[str] = ()) -> None:
        super().__init__()
        self.keys = sorted((k for k in keys if k), key=len, reverse=True)

    def redact(self, text: str) -> str:
        for key in self.keys:
            text = text.replace(key, "[redacted]")
        for pattern, replacement in PATTERNS:
            text = pattern.sub(replacement, text)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args and record.name != "uvicorn.access":  # a header may be split over args: redact the whole
            record.msg, record.args = self.redact(record.getMessage()), ()
            return True
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, tuple):  # uvicorn's access formatter reads its fields from args
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self.redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def install(keys: Iterable[str]) -> None:
    """Attach the filter to the server's loggers and their handlers (call after logging is configured)."""
    secrets = RedactSecrets(keys)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            for old in [f for f in target.filters if isinstance(f, RedactSecrets)]:
                target.removeFilter(old)
            target.addFilter(secrets)
