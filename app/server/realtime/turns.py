"""Turn detection of a live session: where a speaker's turn starts and ends.

Two kinds, as OpenAI's Realtime API names them (`turn_detection.type`):
- `server_vad` (`VadParams`): a turn ends once `silence_duration_ms` of silence followed the speech.
- `semantic_vad` (`SemanticVad`): a turn ends when the words say the speaker is done. At every pause (`PAUSE_MS`
  of silence) the session transcribes the turn so far (its final if the turn ends there) and `reading` classes
  the text: a turn that reads finished ends once the silence has lasted `FINISHED_MS` (500 ms at auto); one
  that reads unsure (no sentence-final mark) waits half the eagerness bound; one that asks for more words
  ("... and", "the", a comma) waits to the bound (`eagerness`: low 8 s, medium and auto 4 s, high 2 s), never
  longer.
`None` (`turn_detection: null`): the client commits each turn itself.

`TurnFollower` runs either over the stream: it turns Silero's speech starts, pauses, resumes and stops into the
session's decisions, and says which samples a turn's transcription hears (`tail`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from app.api.audio import SAMPLE_RATE
from app.api.types import InvalidRequestError
from app.server.vad import IGNORED, WINDOW, SileroVad, SpeechStream, VadEvent, VadParams, server_vad

EAGERNESS_BOUND_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}
# The silence after words that read finished before the turn ends: a reader's pause at a comma is shorter (and
# Whisper may end such a fragment with a full stop).
FINISHED_MS = {"low": 1000, "medium": 500, "high": 250, "auto": 500}
Reading = Literal["finished", "unsure", "continues"]


@dataclass(frozen=True)
class SemanticVad:
    """OpenAI's `semantic_vad`: how eager the server is to end a turn (bounds the wait after speech)."""

    eagerness: str = "auto"

    def __post_init__(self) -> None:
        if self.eagerness not in EAGERNESS_BOUND_MS:
            raise InvalidRequestError(f"eagerness must be one of {', '.join(EAGERNESS_BOUND_MS)}", "eagerness")

    @property
    def bound_ms(self) -> int:
        """The longest silence after speech before the turn ends, whatever its words."""
        return EAGERNESS_BOUND_MS[self.eagerness]

    @property
    def finished_ms(self) -> int:
        """The silence that ends a turn whose words read finished."""
        return FINISHED_MS[self.eagerness]

    @property
    def unsure_ms(self) -> int:
        """The silence that ends a turn whose words may or may not be finished (Whisper leaves the full stop out
        where the voice says the sentence goes on: such a turn is more often unfinished than not)."""
        return self.bound_ms // 2

    @property
    def vad(self) -> VadParams:
        """Silero's settings under it: OpenAI's server-VAD defaults, the bound as the silence that ends a turn."""
        return VadParams(silence_duration_ms=self.bound_ms)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "semantic_vad", "eagerness": self.eagerness}


TurnDetection = VadParams | SemanticVad


def turn_detection(raw: Any, param: str, current: TurnDetection | None) -> TurnDetection | None:
    """A session's `turn_detection` (null: the client commits); fields left out stay as in `current` when the type
    is the same. Raises InvalidRequestError naming the field (`param`.<field>)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{param} must be an object or null", param)
    kind = raw.get("type", "server_vad")
    if kind == "server_vad":
        return server_vad(raw, param, current if isinstance(current, VadParams) else None)
    if kind != "semantic_vad":
        raise InvalidRequestError(
            f"{param}.type {str(kind)[:64]!r} is not supported; use 'server_vad' or 'semantic_vad'", f"{param}.type"
        )
    unknown = sorted(set(raw) - {"type", "eagerness", *IGNORED})
    if unknown:
        raise InvalidRequestError(f"unknown parameter {param}.{unknown[0][:64]}", f"{param}.{unknown[0][:64]}")
    base = current if isinstance(current, SemanticVad) else SemanticVad()
    if raw.get("eagerness") is None:
        return base
    if not isinstance(raw["eagerness"], str) or raw["eagerness"] not in EAGERNESS_BOUND_MS:
        raise InvalidRequestError(
            f"{param}.eagerness must be one of {', '.join(EAGERNESS_BOUND_MS)}", f"{param}.eagerness"
        )
    return replace(base, eagerness=raw["eagerness"])


def describe(detection: TurnDetection | None) -> dict[str, Any] | None:
    """The `turn_detection` object a session echoes."""
    if detection is None:
        return None
    if isinstance(detection, SemanticVad):
        return detection.to_dict()
    return {"type": "server_vad", **detection.to_dict()}


# -- reading a turn's words --------------------------------------------------------------------------------
# Words after which an English sentence goes on: conjunctions, articles, possessives and fillers, whatever the
# punctuation after them; prepositions, auxiliaries and pronouns when no sentence-final mark follows them
# ("What is it about?" and "I saw her." end sentences).
_ALWAYS_CONTINUES = "and or but because if the a an my your our their whose um uh er erm"
_CONTINUES = """so when while although though than that which who whom where to of in on at for with from by about
into like as his her its this these those is are was were be been am will would could should can may might must
have has had do does did not very well then also just"""
ALWAYS_CONTINUES = frozenset(_ALWAYS_CONTINUES.split())
CONTINUES = ALWAYS_CONTINUES | frozenset(_CONTINUES.split())
# Abbreviations whose full stop ends no sentence.
_ABBREVIATIONS = "mr. mrs. ms. dr. prof. st. vs. etc. e.g. i.e. no. mt. jr. sr."
ABBREVIATIONS = frozenset(_ABBREVIATIONS.split())
_FINAL_MARK = re.compile(r"[.!?。！？]['\")\]»”]*$")


def reading(text: str) -> Reading:
    """How a turn's transcript reads: `finished` (a sentence-final mark, not after an abbreviation or a word
    that asks for more), `continues` (it ends on a comma, dash, ellipsis or a word that asks for more), else
    `unsure`."""
    text = text.strip()
    if not text:
        return "unsure"
    last = text.split()[-1].lower()
    bare = last.strip(".,;:!?\"'()[]«»“”‘’…-")
    if text.endswith(("...", "…", ",", ";", ":", "-", "—")) or bare in ALWAYS_CONTINUES:
        return "continues"
    if _FINAL_MARK.search(text) and last not in ABBREVIATIONS:
        return "finished"
    return "continues" if bare in CONTINUES else "unsure"


# -- following the stream ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """A decision about the open turn at `sample` (16-kHz samples since the session began).

    start: speech began (the turn's audio starts `prefix_padding_ms` before it); pause: the speaker paused, and
    `sample` is where the turn would end if the silence lasts (begin its final now); resume: the speech went on;
    stop: the turn ended after silence, its speech up to `sample`, its audio up to `end`; split (semantic VAD): the
    turn had ended at the pause after `sample`, and the speech since `end` is the next turn."""

    kind: Literal["start", "pause", "resume", "stop", "split"]
    sample: int
    end: int = 0


class TurnFollower:
    """One session's turn detection over its 16-kHz stream (server or semantic VAD)."""

    def __init__(self, vad: SileroVad, detection: TurnDetection, at: int = 0) -> None:
        """Turn detection from sample `at` of the session's stream on (the samples it reports count from the
        session's start)."""
        self.detection = detection
        self.params = detection.vad if isinstance(detection, SemanticVad) else detection
        self._stream: SpeechStream = vad.stream(self.params)
        self._at = at
        self._heard = at  # the session's samples fed so far
        self._pause: int | None = None  # the open pause's speech end
        self._end_at: int | None = None  # semantic VAD: the sample at which the paused turn ends
        self._resumed: dict[int, int] = {}  # the open turn's pauses the speech went on from: speech end -> resumed

    @property
    def padding(self) -> int:
        """Samples of audio kept before speech starts (`prefix_padding_ms`)."""
        return self.params.prefix_padding_ms * SAMPLE_RATE // 1000

    @property
    def tail(self) -> int:
        """Samples after a turn's speech end that its transcription hears: the silence the stream holds when a
        pause is reported, so that a quiet last sound (below the VAD's threshold) is in it."""
        return WINDOW + self._stream.pause_after

    @property
    def speaking(self) -> bool:
        return self._stream.speaking

    @property
    def paused_at(self) -> int | None:
        """The speech end of the pause the stream is in (None while speaking or silent)."""
        return self._pause

    def feed(self, samples: np.ndarray) -> Iterator[Turn]:
        """The decisions `samples` lead to, in order."""
        self._heard += samples.size
        for heard in self._stream.feed(samples):
            event = VadEvent(heard.kind, heard.sample + self._at)
            if event.kind == "stop":
                yield self._stop(event.sample, forced=False)
            elif event.kind == "pause":
                self._pause, self._end_at = event.sample, None
                yield Turn("pause", event.sample)
            else:  # start | resume
                if event.kind == "resume" and self._pause is not None:
                    self._resumed[self._pause] = event.sample
                self._pause = self._end_at = None
                yield Turn(event.kind, event.sample)  # type: ignore[arg-type]
        if self._end_at is not None and self._pause is not None and self._heard >= self._end_at:
            yield self._stop(self._pause, forced=True)

    def may_split(self, speech_end: int) -> bool:
        """Semantic VAD: whether words read after the speech went on could still end the turn at the pause after
        `speech_end` (its silence lasted as long as finished words need)."""
        resumed = self._resumed.get(speech_end)
        if not isinstance(self.detection, SemanticVad) or resumed is None:
            return False
        return (resumed - speech_end - WINDOW) * 1000 // SAMPLE_RATE >= self.detection.finished_ms

    def read(self, speech_end: int, text: str) -> Turn | None:
        """Semantic VAD: `text` is the transcript of the turn paused at `speech_end`. Returns the stop when the
        words say the turn is over and the silence has lasted long enough for them; else sets how long it may
        last before it is (None). For a pause the speech has gone on from since, the split there, if the silence
        had lasted long enough."""
        if not isinstance(self.detection, SemanticVad):
            return None
        verdict = reading(text)
        wait_ms = {"finished": self.detection.finished_ms, "unsure": self.detection.unsure_ms}.get(verdict)
        if speech_end in self._resumed:  # too late to end the turn then: split it there
            resumed = self._resumed.pop(speech_end)
            silence_ms = (resumed - speech_end - WINDOW) * 1000 // SAMPLE_RATE
            return Turn("split", speech_end, resumed) if wait_ms is not None and silence_ms >= wait_ms else None
        if self._pause != speech_end or wait_ms is None:
            return None
        self._end_at = speech_end + WINDOW + wait_ms * SAMPLE_RATE // 1000
        return self._stop(speech_end, forced=True) if self._heard >= self._end_at else None

    def _stop(self, speech_end: int, *, forced: bool) -> Turn:
        """The turn ends: its audio runs on past its speech to where the silence that ended it does (the whole
        `silence_duration_ms` when the VAD ended it, what was heard when the words did)."""
        self._pause = self._end_at = None
        self._resumed.clear()
        if forced:
            self._stream.end_turn()
            return Turn("stop", speech_end, self._heard)
        silence = WINDOW + self.params.silence_duration_ms * SAMPLE_RATE // 1000
        return Turn("stop", speech_end, min(speech_end + silence, self._heard))
