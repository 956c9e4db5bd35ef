"""Choices timed once per machine and remembered, so that every start of the server computes the same way.

The encoder's attention runs on whichever of two kernels ran faster here (`app.model.kernels`). The two differ
only in the order of their sums, yet a close call timed anew at each start could give a restarted server other
fp32 bits, and now and then other words, for the same audio (two processes on one machine took different
kernels, and an int8 model's French transcripts then differed by 1.3 points of WER). The first process to time
a choice writes it to a small JSON file beside the kernel library's build cache, keyed by the CPU, its
instruction sets, torch's version and what was timed; later processes on that machine read it. Where the folder
cannot be written (a read-only container), each process times its own, and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from app.model.cpu import cpu_flags, cpu_name
from app.model.native import build_directory

log = logging.getLogger(__name__)

Choice = TypeVar("Choice", bound=str)


def choices_file() -> Path:
    """Where this machine's timed choices are kept."""
    return build_directory("specwhisper_choices") / "choices.json"


def machine_key() -> str:
    """What a timed choice holds for: this CPU model, its instruction sets and this torch."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_name()} (flags {flags}), torch {torch.__version__}"


def remembered(what: str, decide: Callable[[], Choice], path: Path | None = None) -> Choice:
    """The choice `what` made on this machine before, else `decide()`'s, kept for the next process.

    Two processes deciding at once agree: the second to write takes the first one's choice.
    """
    path = path or choices_file()
    key = f"{machine_key()}: {what}"
    known = _read(path)
    if key in known:
        return known[key]  # type: ignore[return-value]
    choice = decide()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            known = _read(path)
            if key in known:
                return known[key]  # type: ignore[return-value]
            known[key] = choice
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(known, indent=1, sort_keys=True))
            temporary.replace(path)
    except OSError as exc:
        log.warning("%s: %s, timed by this process and not kept for the next (%s)", what, choice, exc)
    return choice


def _read(path: Path) -> dict[str, str]:
    """The choices in `path`; none where it is missing or unreadable (it is written again)."""
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(path.read_text())
        if isinstance(known, dict):
            return {str(k): str(v) for k, v in known.items()}
    return {}
