"""Choices timed once per machine and remembered, so that every start of the server computes the same way.

The encoder's attention runs on whichever of two kernels ran faster here (`app.model.kernels`). The two differ
only in the order of their sums, yet a close call timed anew at each start could give a restarted server other
fp32 bits, and now and then other words, for the same audio (an int8 model's French WER on the benchmark was
31.7% with one kernel and 33.0% with the other, and two processes on one machine had timed different ones).
The first process to time a choice writes it to a small JSON file beside the kernel library's build cache,
keyed by the CPU, its instruction sets, torch's version and what was timed; later processes on that machine
read it (delete the file to time again). Where the folder cannot be written (a read-only container), each
process times its own, and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

import torch

from app.model.cpu import cpu_flags, cpu_name
from app.model.native import build_directory

log = logging.getLogger(__name__)

Choice = TypeVar("Choice", bound=str)


def choices_file() -> Path:
    """Where this machine's timed choices are kept (OSError where the folder cannot be made)."""
    return build_directory("specwhisper_choices") / "choices.json"


def machine_key() -> str:
    """What a timed choice holds for: this CPU model, its instruction sets and this torch."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_name()} (flags {flags}), torch {torch.__version__}"


def remembered(
    what: str, allowed: Collection[Choice], decide: Callable[[], Choice], path: Path | None = None
) -> Choice:
    """The choice `what` made on this machine before, else `decide()`'s, kept for the next process.

    One process at a time decides, holding the file's lock: processes starting together take the first one's
    choice, timed without the others competing for the cores. A kept value not in `allowed` is decided again.
    """
    key = f"{machine_key()}: {what}"
    choice: Choice | None = None
    try:
        path = path or choices_file()
        if (known := _allowed(_all(path).get(key), allowed)) is not None:
            return known
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            kept = _all(path)  # read again under the lock: another process may have decided meanwhile
            if (known := _allowed(kept.get(key), allowed)) is not None:
                return known
            choice = decide()
            _write(path, kept | {key: choice})
            log.info("%s: %s, kept in %s", what, choice, path)
            return choice
    except OSError as exc:
        choice = decide() if choice is None else choice
        log.warning("%s: %s, timed by this process and not kept for the next (%s)", what, choice, exc)
        return choice


def _all(path: Path) -> dict[str, object]:
    """Every choice in `path`; none where it is missing or unreadable (it is written again)."""
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(path.read_text())
        if isinstance(known, dict):
            return known
    return {}


def _allowed(value: object, allowed: Collection[Choice]) -> Choice | None:
    """`value` as one of the `allowed` choices; None where it is none of them (or missing)."""
    return next((choice for choice in allowed if choice == value), None)


def _write(path: Path, choices: dict[str, object]) -> None:
    temporary = path.with_suffix(".tmp")  # only the lock's holder writes it
    temporary.write_text(json.dumps(choices, indent=1, sort_keys=True))
    temporary.replace(path)
