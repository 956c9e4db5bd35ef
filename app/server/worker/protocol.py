"""Messages between the web process and the worker process (pickled over a pipe)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.api.audio import EncodedAudio
from app.api.types import DecodingOptions, Segment, Transcription
from app.server.worker.budget import MemoryPlan
from app.server.worker.policy import Estimate, Mode


@dataclass(frozen=True)
class PrintRequest:
    """Voice prints a job asks for (`app.speakers`): over these pieces of its audio ([start, end) samples, the
    speech the VAD found), with its transcription, or `only` them (a known speaker's reference)."""

    pieces: tuple[tuple[int, int], ...]
    only: bool = False


@dataclass(frozen=True)
class Job:
    """A clip to transcribe: its 16-kHz samples, or an upload still encoded (a few hundred kB where its samples
    would be hundreds of MB), which the worker decodes; then `samples` is its decoded length."""

    request_id: str
    audio: np.ndarray | EncodedAudio
    options: DecodingOptions
    stream: bool = False  # send Progress messages as windows complete
    samples: int = 0
    turn: int = 0  # jobs of the same request queued before it (a chunked upload's k-th chunk: k; a resumed job's
    # earlier turns)
    resume: bool = False  # go on with the worker's suspended transcription of this request (`JobResult.suspended`)
    background: bool = False  # work of a long upload: it batches with its kind only, and a short upload or a live
    # final may stop it mid-window (once) to run first (`Batcher`)
    prints: PrintRequest | None = None  # voice prints to take of it (`Transcription.voices`)

    @property
    def length(self) -> int:
        """Its samples at 16 kHz."""
        return self.audio.size if isinstance(self.audio, np.ndarray) else self.samples

    def decoded(self) -> np.ndarray:
        """Its samples (AudioError if encoded audio does not decode)."""
        return self.audio if isinstance(self.audio, np.ndarray) else self.audio.decode()


@dataclass(frozen=True)
class Progress:
    """Segments a streaming job gained in one window, sent before its batch finishes."""

    request_id: str
    segments: list[Segment]


@dataclass(frozen=True)
class BatchRequest:
    batch_id: int
    jobs: list[Job]


@dataclass(frozen=True)
class Cancel:
    """The client of a running job went away: stop it at its next window, and drop it if suspended. `keep`: the job
    is only preempted (it runs again): stop it, but keep it if it ends the batch suspended."""

    request_id: str
    keep: bool = False


@dataclass(frozen=True)
class JobResult:
    request_id: str
    transcription: Transcription | None = None
    error: str | None = None  # message of an invalid request (the others still succeed)
    internal: bool = False  # the error is the server's fault, not the request's
    suspended: bool = False  # not done: its windows so far are kept in the worker, to go on as a `resume` job


@dataclass(frozen=True)
class BatchResult:
    batch_id: int
    results: list[JobResult]
    mode: Mode | None = None  # how the worker decoded it (None: no valid row)
    estimates: list[Estimate] = field(default_factory=list)  # the adaptive policy's, after this batch
    peak_mb: float | None = None  # the worker's resident peak over this batch (None: not measured)
    nested_clips: int = 0  # clips of the batches the worker ran inside this one (their memory is in `peak_mb`)

    def costs(self) -> dict[tuple[str, int], float]:
        """The measured estimates: ms per plain pass by (mode, batch size)."""
        return {(e.mode, e.batch): e.ms_per_plain_pass for e in self.estimates if e.samples > 0}


@dataclass(frozen=True)
class Ready:
    """The worker loaded its models and warmed up; `engine` is `Engine.describe()`; `memory`: its budget's plan, where
    one is set."""

    load_seconds: float
    engine: dict[str, str | int | bool | None]
    memory: MemoryPlan | None = None

    @property
    def model(self) -> str:
        return str(self.engine["model"])

    @property
    def assistant(self) -> str | None:
        name = self.engine.get("assistant")
        return None if name is None else str(name)


@dataclass(frozen=True)
class Heartbeat:
    """The worker is working on its batch (sent as its engine makes progress, at most once a second)."""


@dataclass(frozen=True)
class LoadFailed:
    """The worker could not load its models; it exits after sending this.

    permanent: the settings name no usable model (no such model, not a Whisper checkpoint), so a
    new worker would fail the same way; otherwise (out of memory, a device error) it may not.
    """

    error: str
    permanent: bool


@dataclass(frozen=True)
class Stop:
    pass
