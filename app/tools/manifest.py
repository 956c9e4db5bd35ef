"""The benchmark clips' manifest (`manifest.jsonl` in the benchdata folder): one JSON object per clip.

The one reader of it for the bench, the server bench, the load test, the soak and the tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ManifestClip:
    """One clip: `audio` is its file's path, resolved against the manifest's folder."""

    id: str
    audio: Path
    text: str
    language: str
    duration_s: float
    subset: str | None = None  # "short" or "long"

    def read_bytes(self) -> bytes:
        return self.audio.read_bytes()


def benchdata_dir() -> Path:
    """`SPECWHISPER_BENCHDATA`, else `shared/benchdata` next to the checkout."""
    configured = os.environ.get("SPECWHISPER_BENCHDATA")
    return Path(configured) if configured else REPO.parent / "shared" / "benchdata"


def default_manifest() -> Path:
    return benchdata_dir() / "manifest.jsonl"


def read_manifest(path: Path) -> list[ManifestClip]:
    """Every clip of the manifest at `path`, in its order."""
    clips = []
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            clips.append(
                ManifestClip(
                    id=e["id"],
                    audio=path.parent / e["audio"],
                    text=e["text"],
                    language=e["language"],
                    duration_s=float(e["duration_s"]),
                    subset=e.get("subset"),
                )
            )
    return clips


def select(
    clips: Iterable[ManifestClip],
    *,
    languages: set[str] | None = None,
    subset: str | None = None,
    min_seconds: float = 0.0,
    max_seconds: float = float("inf"),
) -> list[ManifestClip]:
    """The clips in `languages` (None: all) and `subset` (None: all) of `min_seconds`..`max_seconds`, in order."""
    return [
        c
        for c in clips
        if min_seconds <= c.duration_s <= max_seconds
        and (languages is None or c.language in languages)
        and (subset is None or c.subset == subset)
    ]


def shortest(clips: Iterable[ManifestClip], count: int | None = None) -> list[ManifestClip]:
    """The `count` shortest clips (None: all), shortest first; the manifest's order among equal lengths."""
    return sorted(clips, key=lambda c: c.duration_s)[:count]
